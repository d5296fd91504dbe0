//! Ids and clocks: random prefixed ids (`sb_…`, `call_…`), Unix seconds, and milliseconds
//! as the API reports them, the year for certificates' validity, hex digits.
//!
//! A leaf room (it imports nothing of the crate), so the pools and the state can both use
//! it; `state` re-exports it for the handlers.

use std::time::Instant;

/// Milliseconds since `t`, as the API reports them.
pub fn ms_since(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1e3 * 1000.0).round() / 1000.0
}

/// Seconds since the Unix epoch.
pub fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// A random id with a prefix (`sb_…`, `call_…`): 16 hex digits from the kernel's CSPRNG.
pub fn new_id(prefix: &str) -> String {
    locker_sys::random::new_id(prefix, 8)
}

/// Whether `s` is shaped like an id [`new_id`] makes with `prefix` (16 lower-case hex
/// digits after it).
pub fn is_id(s: &str, prefix: &str) -> bool {
    s.strip_prefix(prefix).is_some_and(|rest| {
        rest.len() == 16 && rest.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// Lower-case hex digits of `b`.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes of hex digits (either case); `None` if `s` is not an even run of them.
pub fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The current year (UTC; at worst one off near New Year, which certificates' validity
/// margins cover).
pub fn this_year() -> i32 {
    let s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    1970 + (s / 31_556_952) as i32
}
