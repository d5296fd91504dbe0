//! `locker-jail`: a jail machine's shim, alone. `locker-jail __jail-init <spec>` is what
//! `locker __jail-init <spec>` is (`locker_runtime::jail::init_main`), in a binary holding
//! nothing else, so the once-per-machine start of a fresh process costs what the shim
//! needs and not what the server is made of (the full `locker` carries fifty times the
//! relocations). `locker-jail --build-id` prints the build of its shim code, which a node
//! compares with its own before it runs this binary (`locker_runtime::node::find_shim`).

fn main() {
    let mut args = std::env::args_os().skip(1);
    match args.next() {
        // Single-threaded from here on: nothing runs before the shim.
        Some(a) if a == "__jail-init" => {
            let spec = args
                .next()
                .map(std::path::PathBuf::from)
                .unwrap_or_default();
            locker_runtime::jail::init_main(&spec);
        }
        Some(a) if a == "--build-id" => println!("{}", locker_runtime::jail::SHIM_BUILD),
        _ => {
            eprintln!(
                "locker-jail starts a jail machine for a locker node: `locker-jail __jail-init <spec>` (or `--build-id`); it is not run by hand"
            );
            std::process::exit(2);
        }
    }
}
