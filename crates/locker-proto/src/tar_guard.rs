//! A guard in front of a tar parser for archives from the other side (a client's upload,
//! a machine's download): it watches the record headers as the bytes stream through and
//! fails the read at the first record a parser would handle badly: an extension record
//! (GNU long name or link, PAX header) larger than [`MAX_EXTENSION_BYTES`], which a parser
//! holds whole in memory, and GNU sparse records, whose layout it does not follow.
//!
//! It only inspects headers (sizes and types, PAX `size` overrides included, so it stays in
//! step with the parser); it does not check what entries hold or where they go: that is the
//! extracting side's work.

use std::io::{self, Read};

/// The largest extension record (a long path, a long link target, PAX attributes) let
/// through: far more than any real path, small enough to hold in memory.
pub const MAX_EXTENSION_BYTES: u64 = 1 << 20;

const BLOCK: usize = 512;

/// A [`Read`] that passes `inner`'s bytes on while checking the tar headers in them.
pub struct TarGuard<R> {
    inner: R,
    hdr: [u8; BLOCK],
    hdr_len: usize,
    /// Bytes (padding included) left of the current record's data.
    skip: u64,
    /// The data of a PAX record being read, and how much of it is left.
    pax: Option<(Vec<u8>, u64)>,
    /// A size a PAX record set for the next entry.
    next_size: Option<u64>,
    failed: Option<String>,
}

impl<R: Read> TarGuard<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            hdr: [0; BLOCK],
            hdr_len: 0,
            skip: 0,
            pax: None,
            next_size: None,
            failed: None,
        }
    }

    fn check(&mut self, buf: &[u8]) -> Result<(), String> {
        let mut i = 0;
        while i < buf.len() {
            if self.skip > 0 {
                let take = (self.skip.min((buf.len() - i) as u64)) as usize;
                if let Some((data, left)) = &mut self.pax {
                    let want = (*left).min(take as u64) as usize;
                    data.extend_from_slice(&buf[i..i + want]);
                    *left -= want as u64;
                }
                self.skip -= take as u64;
                i += take;
                if self.skip == 0 {
                    if let Some((data, _)) = self.pax.take() {
                        if let Some(size) = pax_size(&data) {
                            self.next_size = Some(size);
                        }
                    }
                }
                continue;
            }
            let take = (BLOCK - self.hdr_len).min(buf.len() - i);
            self.hdr[self.hdr_len..self.hdr_len + take].copy_from_slice(&buf[i..i + take]);
            self.hdr_len += take;
            i += take;
            if self.hdr_len == BLOCK {
                self.hdr_len = 0;
                self.header()?;
            }
        }
        Ok(())
    }

    fn header(&mut self) -> Result<(), String> {
        let h = &self.hdr;
        if h.iter().all(|b| *b == 0) {
            return Ok(());
        }
        let kind = h[156];
        let mut size = parse_size(&h[124..136])
            .ok_or_else(|| "malformed tar: a header's size field is not a number".to_string())?;
        let extension = matches!(kind, b'x' | b'g' | b'L' | b'K');
        if extension {
            if size > MAX_EXTENSION_BYTES {
                return Err(format!(
                    "malformed tar: an extension record (type {:?}) of {size} bytes, more than \
                     {MAX_EXTENSION_BYTES}",
                    kind as char
                ));
            }
            if kind == b'x' {
                self.pax = Some((Vec::with_capacity(size as usize), size));
            }
        } else {
            if let Some(s) = self.next_size.take() {
                size = s;
            }
            if kind == b'S' {
                return Err(
                    "GNU sparse entries are not supported: archive without --sparse".to_string(),
                );
            }
        }
        self.skip = size
            .checked_add(BLOCK as u64 - 1)
            .map(|s| s / BLOCK as u64 * BLOCK as u64)
            .ok_or_else(|| "malformed tar: a size past 2^64".to_string())?;
        if self.skip == 0 {
            if let Some((data, _)) = self.pax.take() {
                self.next_size = pax_size(&data);
            }
        }
        Ok(())
    }
}

impl<R: Read> Read for TarGuard<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(m) = &self.failed {
            return Err(io::Error::new(io::ErrorKind::InvalidData, m.clone()));
        }
        let n = self.inner.read(buf)?;
        if let Err(m) = self.check(&buf[..n]) {
            self.failed = Some(m.clone());
            return Err(io::Error::new(io::ErrorKind::InvalidData, m));
        }
        Ok(n)
    }
}

/// A header's size field: octal digits, or base-256 when its first byte's top bit is set.
fn parse_size(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        if field[0] & 0x7f != 0 || field[1..4].iter().any(|b| *b != 0) {
            return None;
        }
        return Some(
            field[4..]
                .iter()
                .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)),
        );
    }
    let digits: Vec<u8> = field
        .iter()
        .copied()
        .skip_while(|b| *b == b' ')
        .take_while(|b| (b'0'..=b'7').contains(b))
        .collect();
    if digits.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(std::str::from_utf8(&digits).ok()?, 8).ok()
}

/// The `size` a PAX record's data sets (records are `LEN key=value\n`).
fn pax_size(mut data: &[u8]) -> Option<u64> {
    let mut found = None;
    while !data.is_empty() {
        let sp = data.iter().position(|b| *b == b' ')?;
        let len: usize = std::str::from_utf8(&data[..sp]).ok()?.parse().ok()?;
        if len <= sp || len > data.len() {
            return found;
        }
        let rec = &data[sp + 1..len];
        if let Some(v) = rec.strip_prefix(b"size=") {
            let v = v.strip_suffix(b"\n").unwrap_or(v);
            found = std::str::from_utf8(v).ok().and_then(|s| s.parse().ok());
        }
        data = &data[len..];
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: u8, size: u64) -> Vec<u8> {
        let mut h = vec![0u8; BLOCK];
        h[0] = b'f';
        h[156] = kind;
        let s = format!("{size:011o}");
        h[124..135].copy_from_slice(s.as_bytes());
        h
    }

    fn read_all(bytes: Vec<u8>) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        // Small reads, so headers arrive split.
        let mut g = TarGuard::new(io::Cursor::new(bytes));
        let mut buf = [0u8; 100];
        loop {
            let n = g.read(&mut buf)?;
            if n == 0 {
                return Ok(out);
            }
            out.extend_from_slice(&buf[..n]);
        }
    }

    #[test]
    fn ordinary_records_pass() {
        let mut t = header(b'0', 700);
        t.extend(vec![7u8; 1024]);
        t.extend(header(b'5', 0));
        t.extend(vec![0u8; 1024]);
        assert_eq!(read_all(t.clone()).unwrap(), t);
    }

    #[test]
    fn a_huge_long_name_is_refused() {
        let mut t = header(b'0', 10);
        t.extend(vec![1u8; 512]);
        t.extend(header(b'L', 5 << 30));
        let e = read_all(t).unwrap_err();
        assert!(e.to_string().contains("extension record"), "{e}");
    }

    #[test]
    fn a_pax_size_keeps_the_guard_in_step() {
        let rec = b"16 size=1048576\n";
        let mut t = header(b'x', rec.len() as u64);
        let mut data = rec.to_vec();
        data.resize(BLOCK, 0);
        t.extend(data);
        // The header says 0; the PAX record says 1 MiB of data follows, data that looks
        // like a huge extension header to a guard out of step.
        t.extend(header(b'0', 0));
        let mut body = header(b'L', 5 << 30);
        body.resize(1 << 20, 0);
        t.extend(body);
        t.extend(header(b'L', 10));
        t.extend(vec![b'n'; 512]);
        assert!(read_all(t).is_ok());
    }

    #[test]
    fn sparse_entries_are_refused() {
        assert!(read_all(header(b'S', 0)).is_err());
    }

    #[test]
    fn base_256_sizes_parse() {
        let mut f = [0u8; 12];
        f[0] = 0x80;
        f[11] = 2;
        f[10] = 1;
        assert_eq!(parse_size(&f), Some(258));
    }
}
