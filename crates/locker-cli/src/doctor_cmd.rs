//! `locker doctor`: what works on this host, and what to do about the rest.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct DoctorArgs {
    /// Print the report as JSON: {"runtimes": {...}, "host": {...}, "templates": {...},
    /// "egress": {...}}.
    #[arg(long)]
    json: bool,
    /// The data dir whose filesystem to check.
    #[arg(long, env = "LOCKER_DATA_DIR", default_value = "/var/lib/locker")]
    data_dir: PathBuf,
    /// The template cache to check for the template `default`.
    #[arg(long, env = "LOCKER_CACHE_DIR", default_value = "/var/cache/locker")]
    cache_dir: PathBuf,
}

pub fn run(args: DoctorArgs) -> anyhow::Result<()> {
    let report = locker_runtime::doctor::check(&args.data_dir);
    let templates = locker_runtime::doctor::check_templates(&args.cache_dir);
    // Egress enforcement, proved: a probe namespace wired like a machine must fail to
    // reach the host and the metadata address (needs root, nft, ip, IPv4 forwarding).
    let egress = locker_runtime::net::probe();
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        v["templates"] = serde_json::to_value(&templates)?;
        v["egress"] = match &egress {
            Ok(d) => serde_json::json!({"ok": true, "detail": d}),
            Err(e) => serde_json::json!({"ok": false, "detail": e.to_string()}),
        };
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", locker_runtime::doctor::render(&report));
        print!("{}", locker_runtime::doctor::render_templates(&templates));
        match &egress {
            Ok(d) => println!("egress            enforced: {d}"),
            Err(e) => println!("egress            none only (other policies answer 503): {e}"),
        }
    }
    Ok(())
}
