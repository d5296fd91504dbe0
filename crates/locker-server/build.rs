//! Embeds the dashboard's vendored terminal (xterm.js, installed by `npm ci` in `ui/`, which
//! `scripts/setup` runs) when it is there. A checkout built without npm still builds: the
//! copies in OUT_DIR are then empty, and the dashboard's terminal says what to run.

use std::path::{Path, PathBuf};

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let vendored = [
        ("ui/node_modules/@xterm/xterm/lib/xterm.js", "xterm.js"),
        ("ui/node_modules/@xterm/xterm/css/xterm.css", "xterm.css"),
    ];
    // Watch only paths that exist (cargo reruns a build script whose watched path is missing
    // on every build); without xterm, watch `ui/` so that a later `npm ci` is picked up.
    let lock = root.join("ui/package-lock.json");
    if lock.exists() {
        println!("cargo:rerun-if-changed={}", lock.display());
    }
    let mut missing = false;
    for (src, name) in vendored {
        let src = root.join(src);
        let bytes = match std::fs::read(&src) {
            Ok(b) => {
                println!("cargo:rerun-if-changed={}", src.display());
                b
            }
            Err(_) => {
                missing = true;
                Vec::new()
            }
        };
        // Rewritten only when different, so an unchanged copy does not rebuild the crate.
        let dst = out.join(name);
        if std::fs::read(&dst).ok().as_deref() != Some(&bytes[..]) {
            std::fs::write(&dst, bytes).expect("write into OUT_DIR");
        }
    }
    if missing {
        println!("cargo:rerun-if-changed={}", root.join("ui").display());
    }
}
