//! Extended attributes of a path itself (`l*xattr`: a symlink's own, never its target's).
//! Used on overlayfs upper layers, whose `trusted.overlay.*` attributes say what a layer
//! means; the caller decides which names matter.

use std::ffi::CString;
use std::io;
use std::path::Path;

use crate::{check, cstr};

/// The names of `path`'s extended attributes (empty where it has none or they cannot be
/// read).
pub fn list(path: &Path) -> io::Result<Vec<CString>> {
    let c = cstr(path)?;
    let mut buf = vec![0u8; 4096];
    loop {
        // SAFETY: llistxattr writes at most buf.len() bytes into the buffer we own.
        let n = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        match check(n as libc::c_long) {
            Ok(n) => {
                buf.truncate(n as usize);
                break;
            }
            // The list grew past the buffer; the kernel caps it at 64 KiB.
            Err(e) if e.raw_os_error() == Some(libc::ERANGE) && buf.len() < 1 << 16 => {
                buf.resize(1 << 16, 0);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(buf
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .filter_map(|s| CString::new(s).ok())
        .collect())
}

/// The value of the attribute `name` of `path`, read into `buf`: the bytes it holds
/// (`ERANGE` if the value is longer than `buf`).
pub fn get<'a>(path: &Path, name: &std::ffi::CStr, buf: &'a mut [u8]) -> io::Result<&'a [u8]> {
    let c = cstr(path)?;
    // SAFETY: lgetxattr writes at most buf.len() bytes into the buffer we own; both
    // strings are NUL-terminated.
    let n = unsafe {
        libc::lgetxattr(
            c.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    let n = check(n as libc::c_long)? as usize;
    Ok(&buf[..n])
}

/// Removes the attribute `name` of `path`.
pub fn remove(path: &Path, name: &std::ffi::CStr) -> io::Result<()> {
    let c = cstr(path)?;
    // SAFETY: both strings are NUL-terminated and alive for the call.
    check(unsafe { libc::lremovexattr(c.as_ptr(), name.as_ptr()) }.into()).map(drop)
}

/// Sets the attribute `name` of the file `fd` is open on (a regular file or directory
/// opened for I/O; `O_PATH` fds are refused by the kernel).
pub fn fset(fd: std::os::fd::RawFd, name: &std::ffi::CStr, value: &[u8]) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated; `value` is readable for its length.
    check(
        unsafe { libc::fsetxattr(fd, name.as_ptr(), value.as_ptr().cast(), value.len(), 0) }.into(),
    )
    .map(drop)
}

/// The names of the attributes of the file `fd` is open on (opened for I/O, as [`fset`]).
pub fn flist(fd: std::os::fd::RawFd) -> io::Result<Vec<CString>> {
    let mut buf = vec![0u8; 1024];
    loop {
        // SAFETY: flistxattr writes at most buf.len() bytes into the buffer we own.
        let n = unsafe { libc::flistxattr(fd, buf.as_mut_ptr().cast(), buf.len()) };
        match check(n as libc::c_long) {
            Ok(n) => {
                buf.truncate(n as usize);
                break;
            }
            Err(e) if e.raw_os_error() == Some(libc::ERANGE) && buf.len() < 1 << 16 => {
                buf.resize(1 << 16, 0);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(buf
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .filter_map(|s| CString::new(s).ok())
        .collect())
}

/// The value of the attribute `name` of the file `fd` is open on, read into `buf`
/// (`ERANGE` if the value is longer than `buf`).
pub fn fget<'a>(
    fd: std::os::fd::RawFd,
    name: &std::ffi::CStr,
    buf: &'a mut [u8],
) -> io::Result<&'a [u8]> {
    // SAFETY: fgetxattr writes at most buf.len() bytes into the buffer we own; `name` is
    // NUL-terminated.
    let n = unsafe { libc::fgetxattr(fd, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    let n = check(n as libc::c_long)? as usize;
    Ok(&buf[..n])
}

/// Sets the attribute `name` of `path` to `value`.
pub fn set(path: &Path, name: &std::ffi::CStr, value: &[u8]) -> io::Result<()> {
    let c = cstr(path)?;
    // SAFETY: both strings are NUL-terminated; `value` is readable for its length.
    check(
        unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        }
        .into(),
    )
    .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_set_listed_read_and_removed() {
        let d = std::env::temp_dir().join(format!("locker-sys-xattr-{}", std::process::id()));
        std::fs::write(&d, b"").unwrap();
        let name = c"user.locker.test";
        if let Err(e) = set(&d, name, b"yes") {
            // tmpfs before 6.6 has no user.* attributes: nothing to test there.
            let _ = std::fs::remove_file(&d);
            assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP), "{e}");
            return;
        }
        assert!(list(&d).unwrap().iter().any(|n| n.as_c_str() == name));
        let mut buf = [0u8; 8];
        assert_eq!(get(&d, name, &mut buf).unwrap(), b"yes");
        let mut small = [0u8; 1];
        assert_eq!(
            get(&d, name, &mut small).unwrap_err().raw_os_error(),
            Some(libc::ERANGE)
        );
        let f = std::fs::File::open(&d).unwrap();
        use std::os::fd::AsRawFd;
        assert!(flist(f.as_raw_fd())
            .unwrap()
            .iter()
            .any(|n| n.as_c_str() == name));
        assert_eq!(fget(f.as_raw_fd(), name, &mut buf).unwrap(), b"yes");
        drop(f);
        remove(&d, name).unwrap();
        assert!(list(&d).unwrap().is_empty());
        std::fs::remove_file(&d).unwrap();
    }
}
