//! Lowercase hexadecimal: digests, ids, file names made of random bytes.

/// `bytes` as lowercase hexadecimal, two digits a byte.
pub fn encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

/// The bytes of a hexadecimal string (either case); `None` for an odd length or a
/// character that is not a hex digit.
pub fn decode(s: &str) -> Option<Vec<u8>> {
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let b = s.as_bytes();
    if b.len() & 1 == 1 {
        return None;
    }
    b.chunks(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

/// Whether `b` is a digit of lowercase hexadecimal (what [`encode`] writes).
pub fn is_lower_digit(b: u8) -> bool {
    b.is_ascii_digit() || (b'a'..=b'f').contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        let all: Vec<u8> = (0..=255).collect();
        let s = encode(&all);
        assert_eq!(&s[..8], "00010203");
        assert_eq!(&s[s.len() - 4..], "feff");
        assert!(s.bytes().all(is_lower_digit));
        assert_eq!(decode(&s).unwrap(), all);
        assert_eq!(decode("DEADbeef").unwrap(), [0xde, 0xad, 0xbe, 0xef]);
        assert_eq!(encode(b""), "");
        assert_eq!(decode(""), Some(vec![]));
        assert_eq!(decode("abc"), None);
        assert_eq!(decode("zz"), None);
        assert_eq!(decode("+1"), None);
    }
}
