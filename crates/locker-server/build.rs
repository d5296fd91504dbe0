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
    // A later `npm ci` must be picked up by the next build.
    println!("cargo:rerun-if-changed={}", root.join("ui/node_modules/@xterm/xterm/package.json").display());
    println!("cargo:rerun-if-changed={}", root.join("ui/package-lock.json").display());
    for (src, name) in vendored {
        let src = root.join(src);
        println!("cargo:rerun-if-changed={}", src.display());
        let bytes = std::fs::read(&src).unwrap_or_default();
        std::fs::write(out.join(name), bytes).expect("write into OUT_DIR");
    }
}
