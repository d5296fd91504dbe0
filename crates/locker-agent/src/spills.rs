//! Bounds the spill files that truncated calls leave in the output directory
//! (`<dir>/call_….stdout|stderr`, named in the result's `output_path`).
//!
//! Each truncated exec keeps its full stream there so the caller can fetch it with the files
//! API; without a bound a long-lived sandbox would fill its disk with them. After a call
//! that left one, the oldest are deleted until at most [`KEEP_FILES`] remain and they hold
//! at most [`KEEP_BYTES`] together (the newest file always stays, whatever its size).
//!
//! Owns only those `call_*` files: background processes' spools (`proc_*`) are `procs`'s,
//! and nothing else in the directory is touched. Runs only after a truncated call, never
//! on the common path.

use std::path::Path;
use std::time::SystemTime;

/// How many spill files (one per truncated stream) a machine keeps.
pub const KEEP_FILES: usize = 32;
/// How many bytes of spill files a machine keeps.
pub const KEEP_BYTES: u64 = 256 << 20;

/// Deletes the oldest `call_*` spill files in `dir` past the bounds.
pub fn prune(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut files: Vec<(SystemTime, u64, std::path::PathBuf)> = entries
        .flatten()
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with("call_") && (n.ends_with(".stdout") || n.ends_with(".stderr"))
        })
        .filter_map(|e| {
            let m = e.metadata().ok().filter(|m| m.is_file())?;
            Some((m.modified().ok()?, m.len(), e.path()))
        })
        .collect();
    // Newest first.
    files.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| b.2.cmp(&a.2)));
    let mut bytes = 0u64;
    for (i, (_, len, path)) in files.iter().enumerate() {
        bytes = bytes.saturating_add(*len);
        if i > 0 && (i >= KEEP_FILES || bytes > KEEP_BYTES) {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn keeps_the_newest_within_the_bounds() {
        let dir = std::env::temp_dir().join(format!("spills-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..(super::KEEP_FILES + 5) {
            std::fs::write(dir.join(format!("call_{i:03}.stdout")), b"x").unwrap();
            let t =
                std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i as u64);
            let f = std::fs::File::options()
                .write(true)
                .open(dir.join(format!("call_{i:03}.stdout")))
                .unwrap();
            f.set_modified(t).unwrap();
        }
        std::fs::write(dir.join("proc_1.stdout"), b"spool").unwrap();
        super::prune(&dir);
        let left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left.len(), super::KEEP_FILES + 1, "{left:?}");
        assert!(left.contains(&"proc_1.stdout".to_owned()));
        assert!(!left.contains(&"call_000.stdout".to_owned()));
        assert!(left.contains(&format!("call_{:03}.stdout", super::KEEP_FILES + 4)));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
