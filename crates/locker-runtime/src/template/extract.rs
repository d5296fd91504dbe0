//! Importing a root filesystem tarball: checked, extracted, hashed.

use sha2::{Digest as _, Sha256};
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Stdio;

use super::build::*;
use super::fsutil::*;
use super::progress::*;
use super::spec::*;
use super::store::*;
use super::*;

impl TemplateStore {
    /// Imports a root filesystem tarball (plain, gzip, bzip2, xz or zstd) as template
    /// `name`. Its digest is that of the tarball's bytes; importing the same bytes again
    /// only adds the name.
    pub fn import(
        &self,
        name: &str,
        tarball: &Path,
        progress: &mut dyn Progress,
    ) -> Result<Template, TemplateError> {
        let result = self.import_unfinished(name, tarball, progress);
        progress.finish(result.is_ok());
        result
    }

    pub(super) fn import_unfinished(
        &self,
        name: &str,
        tarball: &Path,
        progress: &mut dyn Progress,
    ) -> Result<Template, TemplateError> {
        validate_name(name)?;
        progress.step("hashing the tarball", 0.0);
        let digest = hash_file(tarball)?;
        self.clean_stale();
        if !self.is_built(&digest) {
            let lock = self.lock(&digest, progress)?;
            if !self.is_built(&digest) {
                self.import_locked(name, tarball, &digest, &lock, progress)?;
            }
        }
        self.set_name(name, &digest)?;
        self.must_load(&digest, name)
    }

    pub(super) fn import_locked(
        &self,
        name: &str,
        tarball: &Path,
        digest: &str,
        lock: &Lock,
        progress: &mut dyn Progress,
    ) -> Result<(), TemplateError> {
        let tmp = TmpDir::create(&self.templates, digest)?;
        let rootfs = tmp.path.join("rootfs");
        fs::create_dir(&rootfs).map_err(io_err("cannot create", &rootfs))?;
        progress.step("extracting the tarball", 0.05);
        extract_tarball(tarball, &rootfs, digest, lock, progress)?;
        ensure_standard_dirs(&rootfs)?;
        let source = tarball
            .canonicalize()
            .unwrap_or_else(|_| tarball.to_path_buf());
        let meta = Meta::new(digest, name, None, Some(source), Vec::new());
        self.commit(tmp, meta, progress)
    }
}

/// Streams `tarball` into `tar -x`, hashing it again on the way so that what lands in the
/// template is exactly what `digest` names.
pub(super) fn extract_tarball(
    tarball: &Path,
    rootfs: &Path,
    digest: &str,
    lock: &Lock,
    progress: &mut dyn Progress,
) -> Result<(), TemplateError> {
    let mut file = File::open(tarball).map_err(io_err("cannot open", tarball))?;
    let total = file.metadata().map(|m| m.len()).unwrap_or(0).max(1);
    let mut magic = [0u8; 6];
    let n = read_full(&mut file, &mut magic).map_err(io_err("cannot read", tarball))?;
    let filter = compression_flag(&magic[..n]);
    let mut cmd = clean_command("tar");
    cmd.arg("--extract")
        .args(filter)
        .args(["--file=-", "--numeric-owner", "--same-owner"]);
    cmd.args(["--same-permissions", "--xattrs", "--xattrs-include=*"])
        .arg("--directory")
        .arg(rootfs);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    sys::die_with_parent(&mut cmd, lock.file.as_raw_fd(), libc::SIGKILL);
    let mut child = cmd.spawn().map_err(|e| spawn_error("tar", e))?;
    let stderr = child.stderr.take().expect("stderr is piped");
    let reader = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let mut hasher = Sha256::new();
    hasher.update(IMPORT_FORMAT.as_bytes());
    hasher.update(b"\n");
    let mut fed = stdin.write_all(&magic[..n]);
    hasher.update(&magic[..n]);
    let mut buf = vec![0u8; 1 << 20];
    let mut done = n as u64;
    loop {
        let k = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io_err("cannot read", tarball)(e));
            }
        };
        hasher.update(&buf[..k]);
        if fed.is_ok() {
            fed = stdin.write_all(&buf[..k]);
        }
        done += k as u64;
        progress.fraction(0.05 + 0.9 * done as f64 / total as f64);
    }
    drop(stdin);
    let status = child
        .wait()
        .map_err(io_err("cannot wait for tar on", tarball))?;
    let errors = reader.join().unwrap_or_default();
    for line in &errors {
        progress.output(line);
    }
    if !status.success() || fed.is_err() {
        let detail = errors
            .first()
            .cloned()
            .unwrap_or_else(|| describe_status(status));
        return Err(TemplateError::BuildFailed {
            step: format!("extracting {}", tarball.display()),
            detail: format!("{detail} (give a tar archive: plain, gzip, bzip2, xz or zstd)"),
        });
    }
    if hex(&hasher.finalize()) != digest {
        return Err(TemplateError::BuildFailed {
            step: format!("importing {}", tarball.display()),
            detail: "the file changed while it was being imported: import it again".into(),
        });
    }
    Ok(())
}

pub(super) fn compression_flag(magic: &[u8]) -> Option<&'static str> {
    match magic {
        [0x1f, 0x8b, ..] => Some("--gzip"),
        [b'B', b'Z', b'h', ..] => Some("--bzip2"),
        [0xfd, b'7', b'z', b'X', b'Z', 0x00, ..] => Some("--xz"),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Some("--zstd"),
        _ => None,
    }
}

pub(super) fn read_full(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The import digest of a file: sha256 of [`IMPORT_FORMAT`], a newline, and its bytes.
pub(super) fn hash_file(path: &Path) -> Result<String, TemplateError> {
    let mut file = File::open(path).map_err(io_err("cannot open", path))?;
    let mut hasher = Sha256::new();
    hasher.update(IMPORT_FORMAT.as_bytes());
    hasher.update(b"\n");
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => hasher.update(&buf[..k]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("cannot read", path)(e)),
        }
    }
    Ok(hex(&hasher.finalize()))
}
