//! The checked conversions between records and columns that both stores share: integers
//! (both databases' are signed), RFC 3339 times and JSON columns.
//!
//! Owns no SQL and no table.

use crate::error::{Result, StoreError};
use crate::model::parse_rfc3339;

pub(crate) fn to_i64(what: &str, v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| StoreError::Invalid(format!("{what} = {v} is too large")))
}

pub(crate) fn from_i64(what: &str, v: i64) -> Result<u64> {
    u64::try_from(v).map_err(|_| StoreError::Corrupt(format!("{what} is negative ({v})")))
}

pub(crate) fn unix_of(what: &str, s: &str) -> Result<i64> {
    parse_rfc3339(s).ok_or_else(|| {
        StoreError::Invalid(format!(
            "{what} {s:?} is not an RFC 3339 time such as 2026-11-30T12:00:00Z"
        ))
    })
}

pub(crate) fn to_json<T: serde::Serialize>(what: &str, v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| StoreError::Invalid(format!("{what}: {e}")))
}

pub(crate) fn from_json<T: serde::de::DeserializeOwned>(what: &str, s: &str) -> Result<T> {
    serde_json::from_str(s).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}
