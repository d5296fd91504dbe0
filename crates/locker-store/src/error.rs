//! The one error type of the store. Every message says what failed and, where a caller
//! can do something about it, what to do.

use std::path::PathBuf;

/// Everything a [`Store`](crate::Store) method can fail with.
///
/// The server maps these onto HTTP: `NotFound` → 404, `Conflict` → 409, `Invalid` → 400,
/// everything else → 500.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The thing named in the message does not exist (or belongs to another tenant).
    #[error("{0}")]
    NotFound(String),
    /// The thing already exists, or its current state forbids the change.
    #[error("{0}")]
    Conflict(String),
    /// The caller passed a value the store cannot accept; the message says which and why.
    #[error("{0}")]
    Invalid(String),
    /// The database file was written by a newer Locker than this one.
    #[error(
        "database {path} has schema version {found}, but this Locker only knows versions up \
         to {supported}: run the newer Locker that wrote it, or point --data-dir elsewhere"
    )]
    SchemaTooNew {
        path: PathBuf,
        found: i64,
        supported: i64,
    },
    /// The database file could not be opened or prepared.
    #[error(
        "cannot open database {path}: {source} (check that its directory exists and is \
         writable by this user, and that no other program holds it locked)"
    )]
    Open {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    /// A query failed.
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The Postgres database was written by a newer Locker than this one.
    #[error(
        "the Postgres database {target} has schema version {found}, but this Locker only \
         knows versions up to {supported}: run the newer Locker that wrote it, or point \
         --database elsewhere"
    )]
    PgSchemaTooNew {
        /// The database's URL without its password.
        target: String,
        found: i64,
        supported: i64,
    },
    /// The Postgres server could not be reached or refused the login.
    #[error(
        "cannot connect to the Postgres database {target}: {} (check that the server \
         runs and accepts this user from this host, and that the database exists: \
         `createdb NAME`)",
        pg_message(source)
    )]
    PgConnect {
        /// The database's URL without its password.
        target: String,
        #[source]
        source: postgres::Error,
    },
    /// A query on Postgres failed.
    #[error("database error: {}", pg_message(.0))]
    Postgres(#[from] postgres::Error),
    /// The store's database connections are gone (the store is shutting down, or a query
    /// panicked).
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// A stored row did not decode; the database was edited by hand or is damaged.
    #[error("corrupt row in the database: {0}")]
    Corrupt(String),
    /// Reading the kernel's random source (`getrandom(2)`) failed.
    #[error("cannot read the kernel's random source (getrandom): {0}")]
    Random(#[source] std::io::Error),
}

/// A Postgres error with what the server said (tokio-postgres's own text is only "db
/// error"): severity, message and detail, or the chain of causes of a connection error.
fn pg_message(e: &postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut s = format!("{}: {}", db.severity(), db.message());
        if let Some(d) = db.detail() {
            s.push_str(&format!(" ({d})"));
        }
        return s;
    }
    let mut s = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        s.push_str(&format!(": {c}"));
        cause = c.source();
    }
    s
}

/// The store's result type.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;
