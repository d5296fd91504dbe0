//! The checked conversions between records and columns that every concern's SQL shares:
//! integers (SQLite's are signed), RFC 3339 times, JSON columns, and uniqueness errors.
//!
//! Owns no SQL and no table.

use rusqlite::ErrorCode;

pub(super) use crate::codec::{from_i64, from_json, to_i64, to_json, unix_of};
use crate::error::StoreError;

/// Maps a uniqueness violation to `Conflict` with `msg`, anything else unchanged.
pub(super) fn conflict_on_unique(e: rusqlite::Error, msg: impl FnOnce() -> String) -> StoreError {
    match e {
        rusqlite::Error::SqliteFailure(ref f, _) if f.code == ErrorCode::ConstraintViolation => {
            StoreError::Conflict(msg())
        }
        e => StoreError::Sqlite(e),
    }
}
