//! The kernel's random source, and what is made of it: random bytes, ids, and entropy
//! handed to a restored guest's kernel. One `getrandom(2)` call site for all of Locker.

use std::io;
use std::os::fd::AsRawFd;

use crate::check_int;

/// Fills `buf` from the kernel's random source (`getrandom(2)`, blocking until the pool is
/// initialised, which happens early in boot), retrying short reads and interruptions.
pub fn fill_random(buf: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: the kernel writes at most `rest.len()` bytes into the live buffer.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n >= 0 {
            filled += n as usize;
            continue;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

/// Fills `buf` with random bytes.
///
/// # Panics
/// If the kernel has no `getrandom(2)` (before Linux 3.17): Locker needs 5.6 or later
/// (`openat2`), so this cannot happen on a host or guest that runs it, and a predictable
/// fallback (the clock) would make ids and keys guessable.
pub fn random_bytes(buf: &mut [u8]) {
    if let Err(e) = fill_random(buf) {
        panic!("the kernel's random source failed ({e}): Locker needs getrandom(2)");
    }
}

/// `prefix` followed by `bytes` random bytes in lowercase hex (`sb_` and 8 bytes:
/// `sb_0c4f…`, 16 digits).
///
/// # Panics
/// As [`random_bytes`].
pub fn new_id(prefix: &str, bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    random_bytes(&mut b);
    let mut s = String::with_capacity(prefix.len() + 2 * bytes);
    s.push_str(prefix);
    s.push_str(&crate::hex::encode(&b));
    s
}

/// Mixes `entropy` into the kernel's pool, crediting it, and reseeds the CRNG
/// (`RNDADDENTROPY`, `RNDRESEEDCRNG`; root only): what a guest restored from a snapshot
/// needs before it makes any secret, since it would otherwise repeat its snapshot's.
pub fn credit_entropy(entropy: &[u8]) -> io::Result<()> {
    if entropy.is_empty() {
        return Ok(());
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + entropy.len());
    info.extend_from_slice(&((entropy.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(entropy.len() as i32).to_ne_bytes());
    info.extend_from_slice(entropy);
    info.resize(8 + entropy.len().div_ceil(4) * 4, 0);
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    // SAFETY: the buffer is a rand_pool_info of the length it declares.
    check_int(unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) })?;
    // SAFETY: no argument.
    check_int(unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG, 0) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_bytes_differ_and_fill_the_whole_buffer() {
        let (mut a, mut b) = ([0u8; 64], [0u8; 64]);
        random_bytes(&mut a);
        random_bytes(&mut b);
        assert_ne!(a, b);
        // 64 zero bytes in a row from a working source: 2^-512.
        assert!(a.iter().any(|&x| x != 0) && b[32..].iter().any(|&x| x != 0));
        let mut big = vec![0u8; 1 << 20];
        fill_random(&mut big).unwrap();
        assert!(
            big[(1 << 20) - 64..].iter().any(|&x| x != 0),
            "a short read was not retried"
        );
        fill_random(&mut []).unwrap();
    }

    #[test]
    fn ids_have_their_prefix_and_length_and_differ() {
        let a = new_id("sb_", 8);
        assert!(a.starts_with("sb_") && a.len() == 3 + 16, "{a}");
        assert!(a[3..].bytes().all(crate::hex::is_lower_digit));
        assert_ne!(a, new_id("sb_", 8));
        assert_eq!(new_id("x", 12).len(), 1 + 24);
    }
}
