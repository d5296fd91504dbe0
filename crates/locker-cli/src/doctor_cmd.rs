//! `locker doctor`: what works on this host, and what to do about the rest.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct DoctorArgs {
    /// Print the report as JSON: {"runtimes": {...}, "host": {...}}.
    #[arg(long)]
    json: bool,
    /// The data dir whose filesystem to check.
    #[arg(long, env = "LOCKER_DATA_DIR", default_value = "/var/lib/locker")]
    data_dir: PathBuf,
}

pub fn run(args: DoctorArgs) -> anyhow::Result<()> {
    let report = locker_runtime::doctor::check(&args.data_dir);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", locker_runtime::doctor::render(&report));
    }
    Ok(())
}
