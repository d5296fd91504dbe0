//! `LOCKER_SHIM_BUILD`: a hash of the sources a jail's shim is made of (this crate and the
//! crates below it that speak to the server: `locker-sys`, `locker-types`, `locker-proto`),
//! so a node runs a separate `locker-jail` only when it was built from the same code as
//! itself (see `node::config::find_shim`). Deterministic: the same sources give the same id.

use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else {
            out.push(p);
        }
    }
}

fn main() {
    let here = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let crates = here.parent().expect("crates/").to_path_buf();
    let mut all = Vec::new();
    for name in [
        "locker-runtime",
        "locker-sys",
        "locker-types",
        "locker-proto",
    ] {
        let dir = crates.join(name);
        for part in ["src", "Cargo.toml"] {
            let p = dir.join(part);
            println!("cargo:rerun-if-changed={}", p.display());
            if p.is_dir() {
                files(&p, &mut all);
            } else {
                all.push(p);
            }
        }
    }
    all.sort();
    let mut h = DefaultHasher::new();
    for p in &all {
        h.write(
            p.strip_prefix(&crates)
                .unwrap_or(p)
                .as_os_str()
                .as_encoded_bytes(),
        );
        h.write(&std::fs::read(p).unwrap_or_default());
    }
    println!("cargo:rustc-env=LOCKER_SHIM_BUILD={:016x}", h.finish());
}
