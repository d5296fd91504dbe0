//! Identifiers and secrets from the kernel's random source.
//!
//! Owns: the shape of IDs (`<prefix>_<24 hex digits>`) and of API
//! keys (`lk_<52 base32 letters>`, 256 random bits). It does not know where they are stored.

use crate::error::{Result, StoreError};

/// Random bytes in an ID: 96 bits, so collisions are out of reach for any one server.
const ID_BYTES: usize = 12;
/// Random bytes in an API key: 256 bits, far past guessing.
const KEY_BYTES: usize = 32;
/// The prefix of every key Locker generates (a user-chosen `LOCKER_API_KEY` may differ).
pub const API_KEY_PREFIX: &str = "lk_";

/// Fills `buf` from the kernel's random source (`locker-sys`'s one `getrandom` call).
pub fn fill_random(buf: &mut [u8]) -> Result<()> {
    locker_sys::random::fill_random(buf).map_err(StoreError::Random)
}

/// A new ID such as `sb_0c4f…` (`prefix` without the underscore: `"sb"`, `"call"`, …).
///
/// # Panics
/// If the kernel's random source fails: a Linux host without it cannot run Locker at all.
pub fn new_id(prefix: &str) -> String {
    let mut buf = [0u8; ID_BYTES];
    if let Err(e) = fill_random(&mut buf) {
        panic!("{e}: Locker needs the kernel's random source to make IDs");
    }
    format!("{prefix}_{}", hex(&buf))
}

/// A new clear API key: `lk_` and 256 random bits in lowercase base32.
pub(crate) fn new_api_key() -> Result<String> {
    let mut buf = [0u8; KEY_BYTES];
    fill_random(&mut buf)?;
    Ok(format!("{API_KEY_PREFIX}{}", base32(&buf)))
}

/// The prefix of a sandbox's preview token.
pub const PREVIEW_TOKEN_PREFIX: &str = "lpt_";

/// A new preview token: `lpt_` and 192 random bits in lowercase base32. It opens a
/// sandbox's private ports through preview URLs, nothing else.
///
/// # Panics
/// If the kernel's random source fails (as [`new_id`]).
pub fn new_preview_token() -> String {
    let mut buf = [0u8; 24];
    if let Err(e) = fill_random(&mut buf) {
        panic!("{e}: Locker needs the kernel's random source to make tokens");
    }
    format!("{PREVIEW_TOKEN_PREFIX}{}", base32(&buf))
}

pub(crate) use locker_sys::hex::encode as hex;

/// RFC 4648 base32, lowercased, without padding: letters and digits only, so a key
/// survives shells, URLs and double-click selection.
pub(crate) fn base32(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut s = String::with_capacity(bytes.len().div_ceil(5) * 8);
    let (mut acc, mut bits) = (0u32, 0u32);
    for &b in bytes {
        acc = (acc << 8) | u32::from(b);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            s.push(ALPHABET[((acc >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        s.push(ALPHABET[((acc << (5 - bits)) & 31) as usize] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base32_matches_rfc4648_vectors() {
        // RFC 4648 section 10, lowercased and unpadded.
        assert_eq!(base32(b""), "");
        assert_eq!(base32(b"f"), "my");
        assert_eq!(base32(b"fo"), "mzxq");
        assert_eq!(base32(b"foo"), "mzxw6");
        assert_eq!(base32(b"foob"), "mzxw6yq");
        assert_eq!(base32(b"fooba"), "mzxw6ytb");
        assert_eq!(base32(b"foobar"), "mzxw6ytboi");
    }

    #[test]
    fn ids_and_keys_have_their_shape_and_differ() {
        let a = new_id("sb");
        let b = new_id("sb");
        assert_ne!(a, b);
        assert_eq!(a.len(), 3 + 2 * ID_BYTES);
        assert!(a[3..].bytes().all(|c| c.is_ascii_hexdigit()));
        let k = new_api_key().unwrap();
        assert!(k.starts_with("lk_"));
        assert_eq!(k.len(), 3 + 52);
        assert_ne!(k, new_api_key().unwrap());
    }
}
