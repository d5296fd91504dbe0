//! Decoding a request's body and encoding replies: the checks every byte of a guest's
//! request passes before an op sees it (lengths, names, offsets), and the reply shapes.

use std::ffi::CStr;
use std::io;

use super::wire::*;
use super::{NAME_MAX, TTL_SECS};

/// An error for the guest: the errno its reply carries (negated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Errno(pub(super) i32);

impl From<io::Error> for Errno {
    fn from(e: io::Error) -> Self {
        // The kernel refuses replies with errors outside 1..512; those become EIO.
        Errno(
            e.raw_os_error()
                .filter(|n| (1..512).contains(n))
                .unwrap_or(libc::EIO),
        )
    }
}

pub(super) type Res<T = ()> = Result<T, Errno>;

/// Reads a `T` from the front of `b` and returns it with the rest; `EINVAL` if too short.
pub(super) fn take<T: Le>(b: &[u8]) -> Res<(T, &[u8])> {
    if b.len() < T::N {
        return Err(Errno(libc::EINVAL));
    }
    Ok((T::get(b), &b[T::N..]))
}

/// A name component as the kernel sends it: exactly `name\0`, and a plain name.
pub(super) fn one_name(b: &[u8]) -> Res<&CStr> {
    let name = CStr::from_bytes_with_nul(b).map_err(|_| Errno(libc::EINVAL))?;
    check_name(name)
}

/// Two NUL-terminated strings back to back (`a\0b\0`), neither checked as a name.
pub(super) fn two_strings(b: &[u8]) -> Res<(&CStr, &CStr)> {
    let nul = b.iter().position(|&c| c == 0).ok_or(Errno(libc::EINVAL))?;
    let a = CStr::from_bytes_with_nul(&b[..=nul]).map_err(|_| Errno(libc::EINVAL))?;
    let z = CStr::from_bytes_with_nul(&b[nul + 1..]).map_err(|_| Errno(libc::EINVAL))?;
    Ok((a, z))
}

/// Refuses what is not one plain component: empty (`ENOENT`), `.`, `..` or with `/`
/// (`EINVAL`), too long (`ENAMETOOLONG`).
pub(super) fn check_name(name: &CStr) -> Res<&CStr> {
    let b = name.to_bytes();
    match b {
        [] => Err(Errno(libc::ENOENT)),
        b"." | b".." => Err(Errno(libc::EINVAL)),
        _ if b.contains(&b'/') => Err(Errno(libc::EINVAL)),
        _ if b.len() > NAME_MAX => Err(Errno(libc::ENAMETOOLONG)),
        _ => Ok(name),
    }
}

/// A guest offset as a host one: `EINVAL` past `i64::MAX`.
pub(super) fn offset(v: u64) -> Res<i64> {
    i64::try_from(v).map_err(|_| Errno(libc::EINVAL))
}

pub(super) fn attr_of(st: &libc::stat) -> Attr {
    Attr {
        ino: st.st_ino,
        size: st.st_size as u64,
        blocks: st.st_blocks as u64,
        atime: st.st_atime as u64,
        mtime: st.st_mtime as u64,
        ctime: st.st_ctime as u64,
        atimensec: st.st_atime_nsec as u32,
        mtimensec: st.st_mtime_nsec as u32,
        ctimensec: st.st_ctime_nsec as u32,
        mode: st.st_mode,
        nlink: u32::try_from(st.st_nlink).unwrap_or(u32::MAX),
        uid: st.st_uid,
        gid: st.st_gid,
        // A 32-bit `new_encode_dev`, which glibc's encoding equals for majors below 4096.
        rdev: st.st_rdev as u32,
        blksize: st.st_blksize as u32,
        flags: 0,
    }
}

pub(super) fn put_entry(out: &mut Vec<u8>, nodeid: u64, st: &libc::stat) {
    EntryOut {
        nodeid,
        generation: 0,
        entry_valid: TTL_SECS,
        attr_valid: TTL_SECS,
        entry_valid_nsec: 0,
        attr_valid_nsec: 0,
        attr: attr_of(st),
    }
    .put(out);
}

pub(super) fn put_attr(out: &mut Vec<u8>, st: &libc::stat) {
    AttrOut {
        attr_valid: TTL_SECS,
        attr_valid_nsec: 0,
        dummy: 0,
        attr: attr_of(st),
    }
    .put(out);
}

/// The file type bits of a mode.
pub(super) fn kind(mode: u32) -> u32 {
    mode & libc::S_IFMT
}

/// The reply to an open: the new handle, no flags.
pub(super) fn put_open(out: &mut Vec<u8>, fh: u64) {
    OpenOut {
        fh,
        open_flags: 0,
        padding: 0,
    }
    .put(out);
}

/// The request's body: after the header, before any extensions (`total_extlen`).
pub(super) fn body_of<'a>(h: &InHeader, payload: &'a [u8]) -> Res<&'a [u8]> {
    if h.len as usize != payload.len() {
        return Err(Errno(libc::EINVAL));
    }
    let ext = usize::from(h.total_extlen) * 8;
    let end = payload.len().checked_sub(ext).filter(|&e| e >= InHeader::N);
    Ok(&payload[InHeader::N..end.ok_or(Errno(libc::EINVAL))?])
}
