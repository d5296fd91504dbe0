//! `locker db`: the state database. `migrate --to postgres://…` copies a stopped server's
//! SQLite database (`<data-dir>/db.sqlite`) into an empty Postgres database, every table
//! in one transaction, and says how many rows of each it copied.

use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum DbCmd {
    /// Copy this host's SQLite state into an empty Postgres database (stop `locker serve`
    /// first; start it again with `--database URL`). Nothing is copied unless everything is.
    Migrate(MigrateArgs),
}

#[derive(clap::Args)]
pub struct MigrateArgs {
    /// The Postgres database to fill: `postgres://USER:PASSWORD@HOST:PORT/DB`. It must
    /// exist (`createdb`) and hold no Locker data yet.
    #[arg(long, value_name = "URL", value_parser = crate::serve_cmd::parse_database)]
    to: String,
    /// The data dir of the server whose state moves.
    #[arg(long, env = "LOCKER_DATA_DIR", default_value = "/var/lib/locker")]
    data_dir: PathBuf,
    /// Print the rows copied per table as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(c: DbCmd) -> anyhow::Result<()> {
    match c {
        DbCmd::Migrate(a) => migrate(a),
    }
}

fn migrate(a: MigrateArgs) -> anyhow::Result<()> {
    // The server's own lock: a running server would write rows the copy does not see.
    let _lock = locker_server::state::DataDirLock::take(&a.data_dir)
        .map_err(|e| anyhow::anyhow!("{e} (stop `locker serve` before migrating its data)"))?;
    let db = a.data_dir.join("db.sqlite");
    let report = locker_store::copy_sqlite_to_postgres(&db, &a.to)?;
    let target = locker_store::redact_url(&a.to);
    if a.json {
        let tables: serde_json::Map<String, serde_json::Value> = report
            .tables
            .iter()
            .map(|(t, n)| (t.clone(), (*n).into()))
            .collect();
        println!(
            "{}",
            serde_json::json!({"from": db, "to": target, "rows": report.total(), "tables": tables})
        );
    } else {
        println!(
            "copied {} rows from {} to {target}:",
            report.total(),
            db.display()
        );
        for (t, n) in &report.tables {
            println!("  {t:<18} {n}");
        }
        println!(
            "every table's count matches. Start the server with `locker serve --data-dir {} \
             --database <URL>`; {} stays as it was (a fallback).",
            a.data_dir.display(),
            db.display()
        );
    }
    Ok(())
}
