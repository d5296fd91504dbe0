//! Unpacking image layers into the root filesystem being built, one tar stream at a time,
//! in order.
//!
//! Every path is resolved inside the root (`openat2(RESOLVE_IN_ROOT)`): a symlink that a
//! layer planted, absolute or full of `..`, points at the root being built, never at the
//! host, so a later entry written "through" it lands inside the root. The last component
//! of an entry is never followed: it is created, replaced or removed with the `*at` calls
//! on its parent's descriptor. Entries naming `..` are refused outright (no real image
//! has them; they only appear in archives made to escape), as are device nodes (a machine
//! gets its devices from the runtime, never from an image), GNU sparse files and PAX
//! records this reader cannot honour. Hard links may only name a file already inside the
//! root. Modes with their setuid/setgid bits, owners (when running as root), times and the
//! extended attributes `user.*` and `security.capability` are kept: the root filesystem
//! is only ever run inside a machine. Other attributes (`trusted.*`, overlayfs's own, ACLs)
//! are dropped, since a template is an overlayfs lower layer and `trusted.overlay.*` there
//! would change what a machine sees.
//!
//! Whiteouts follow the OCI layer rules: `.wh.NAME` removes `NAME` from the layers below,
//! `.wh..wh..opq` empties its directory of what the layers below put there (entries of the
//! same layer stay); neither is ever written into the root.
//!
//! Bounds: the uncompressed tar streams of all layers together (headers included) may not
//! exceed [`ImageLimits::max_unpacked_bytes`]; a file whose header alone declares more is
//! refused before a byte of it is read, so a sparse 10 GB file or a decompression bomb
//! (gzip or zstd) costs nothing. Runs of zeros are written as holes.
//!
//! This room writes only below the root it was given and knows nothing of registries,
//! archives or the template cache.

use flate2::read::MultiGzDecoder;
use sha2::{Digest as _, Sha256};
use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::fs::{File, Permissions};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use locker_sys::fd as sysfd;

use super::super::fsutil::hex;
use super::super::*;
use super::ImageLimits;

/// Longest path or link target accepted (GNU long names, PAX `path`).
const MAX_NAME: u64 = 64 << 10;
/// Largest PAX header accepted for one entry.
const MAX_PAX: u64 = 1 << 20;
/// Deepest path accepted: removal recurses once per level.
const MAX_DEPTH: usize = 256;
/// Largest extended attribute value accepted.
const MAX_XATTR: usize = 64 << 10;
const CHUNK: usize = 256 << 10;

/// What one layer did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LayerSummary {
    /// Entries applied (whiteouts included).
    pub(crate) entries: u64,
    /// File bytes written (apparent sizes).
    pub(crate) bytes: u64,
    /// Extended attributes dropped (names outside `user.*` and `security.capability`).
    pub(crate) dropped_xattrs: u64,
}

/// Applies layers, in order, to one root filesystem.
pub(crate) struct Unpacker {
    root: OwnedFd,
    proc_fd: OwnedFd,
    limits: ImageLimits,
    /// Bytes of uncompressed tar stream read so far, all layers.
    stream: u64,
    /// File bytes written so far, all layers.
    written: u64,
    chown: bool,
    /// Paths created by the layer being applied (an opaque directory keeps them).
    this_layer: HashSet<Vec<u8>>,
    /// The parent directory of the last entry, while nothing was removed since.
    parent_cache: Option<(Vec<u8>, OwnedFd)>,
}

/// Why a layer was refused: kept apart from I/O errors so that callers can say 400 or 413.
fn bad(label: &str, what: impl std::fmt::Display) -> TemplateError {
    TemplateError::BadImage(format!("{label}: {what}"))
}

fn too_big(what: impl std::fmt::Display) -> TemplateError {
    TemplateError::ImageTooBig(what.to_string())
}

/// A layer's bytes as a tar stream: decompressed as its first bytes say.
pub(crate) fn decompress<'a, R: Read + 'a>(
    raw: R,
    label: &str,
) -> Result<Box<dyn Read + 'a>, TemplateError> {
    let mut buf = BufReader::with_capacity(CHUNK, raw);
    let head = buf
        .fill_buf()
        .map_err(|e| bad(label, format!("cannot read the layer: {e}")))?;
    match head {
        [0x1f, 0x8b, ..] => Ok(Box::new(MultiGzDecoder::new(buf))),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Ok(Box::new(ZstdFrames::new(buf))),
        [b'B', b'Z', b'h', ..] | [0xfd, b'7', b'z', b'X', b'Z', ..] => Err(bad(
            label,
            "the layer is bzip2- or xz-compressed, which the OCI image format does not allow: use gzip or plain tar",
        )),
        _ => Ok(Box::new(buf)),
    }
}

/// A zstd stream of one or more frames (skippable frames, such as `zstd:chunked`'s
/// metadata, passed over), decoded by `ruzstd`, a pure-Rust decoder. Its memory is
/// bounded by the decoder's own cap on a frame's window; the bytes it yields are bounded by
/// the caller's [`Metered`], as with gzip.
struct ZstdFrames<R: BufRead> {
    /// The frame being decoded, or the stream between frames.
    state: Option<ZstdState<R>>,
}

enum ZstdState<R: BufRead> {
    Between(R),
    Frame(Box<ruzstd::decoding::StreamingDecoder<R, ruzstd::decoding::FrameDecoder>>),
}

/// The magic numbers of skippable frames: `0x184D2A5?`, little-endian.
fn is_skippable(head: &[u8]) -> bool {
    head.len() >= 4 && head[0] & 0xf0 == 0x50 && head[1..4] == [0x2a, 0x4d, 0x18]
}

impl<R: BufRead> ZstdFrames<R> {
    fn new(inner: R) -> Self {
        ZstdFrames {
            state: Some(ZstdState::Between(inner)),
        }
    }
}

impl<R: BufRead> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            match self.state.take() {
                None => return Ok(0),
                Some(ZstdState::Frame(mut d)) => {
                    let n = d.read(buf)?;
                    if n > 0 {
                        self.state = Some(ZstdState::Frame(d));
                        return Ok(n);
                    }
                    self.state = Some(ZstdState::Between(d.into_inner()));
                }
                Some(ZstdState::Between(mut r)) => {
                    let head = r.fill_buf()?;
                    if head.is_empty() {
                        return Ok(0);
                    }
                    if is_skippable(head) {
                        let mut h = [0u8; 8];
                        r.read_exact(&mut h)?;
                        let len = u64::from(u32::from_le_bytes([h[4], h[5], h[6], h[7]]));
                        let skipped = io::copy(&mut (&mut r).take(len), &mut io::sink())?;
                        if skipped != len {
                            return Err(io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                "a zstd skippable frame ends early",
                            ));
                        }
                        self.state = Some(ZstdState::Between(r));
                        continue;
                    }
                    let d = ruzstd::decoding::StreamingDecoder::new(r).map_err(|e| {
                        io::Error::new(io::ErrorKind::InvalidData, format!("zstd: {e}"))
                    })?;
                    self.state = Some(ZstdState::Frame(Box::new(d)));
                }
            }
        }
    }
}

/// A reader that counts and hashes what passes and refuses to pass more than `limit`.
pub(crate) struct Metered<R> {
    pub(crate) inner: R,
    pub(crate) hasher: Sha256,
    pub(crate) count: u64,
    pub(crate) limit: u64,
    pub(crate) exceeded: bool,
}

impl<R: Read> Metered<R> {
    pub(crate) fn new(inner: R, limit: u64) -> Self {
        Metered {
            inner,
            hasher: Sha256::new(),
            count: 0,
            limit,
            exceeded: false,
        }
    }

    /// Reads what is left (a tar stream's padding after its end blocks) so the hash covers
    /// it all.
    pub(crate) fn drain(&mut self) -> io::Result<()> {
        io::copy(self, &mut io::sink()).map(drop)
    }

    /// `sha256:<hex>` of everything read.
    pub(crate) fn digest(&self) -> String {
        format!("sha256:{}", hex(&self.hasher.clone().finalize()))
    }
}

impl<R: Read> Read for Metered<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count += n as u64;
        if self.count > self.limit {
            self.exceeded = true;
            return Err(io::Error::other("size limit reached"));
        }
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// The kinds of entries a layer may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    File,
    Dir,
    Symlink,
    HardLink,
    Fifo,
}

/// One entry's metadata, its PAX records applied.
struct Meta {
    path: Vec<u8>,
    link: Option<Vec<u8>>,
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: i64,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// GNU long names and PAX records seen before the entry they describe.
#[derive(Default)]
pub(crate) struct Pending {
    long_name: Option<Vec<u8>>,
    long_link: Option<Vec<u8>>,
    pax: Option<Vec<u8>>,
}

impl Pending {
    /// Takes in `entry` if it only describes the next one (a long name, a PAX header, a
    /// global PAX header); `Ok(true)` then. These are read with a bound, unlike the tar
    /// crate's own handling, which would read any size into memory.
    pub(crate) fn absorb<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        label: &str,
    ) -> Result<bool, TemplateError> {
        let ty = entry.header().entry_type();
        let (slot, max, what) = if ty.is_gnu_longname() {
            (&mut self.long_name, MAX_NAME, "a GNU long name")
        } else if ty.is_gnu_longlink() {
            (&mut self.long_link, MAX_NAME, "a GNU long link name")
        } else if ty.is_pax_local_extensions() {
            (&mut self.pax, MAX_PAX, "a PAX header")
        } else if ty.is_pax_global_extensions() {
            read_small(entry, MAX_PAX, "a global PAX header", label)?;
            return Ok(true);
        } else {
            return Ok(false);
        };
        if slot.is_some() {
            return Err(bad(label, format!("two of {what} for one entry")));
        }
        let mut data = read_small(entry, max, what, label)?;
        if !ty.is_pax_local_extensions() {
            while data.last() == Some(&0) {
                data.pop();
            }
        }
        *slot = Some(data);
        Ok(true)
    }

    /// The path and link target of `entry` (an archive's member), from what came before.
    pub(crate) fn take_path<R: Read>(
        &mut self,
        entry: &tar::Entry<'_, R>,
        label: &str,
    ) -> Result<(Vec<u8>, Option<Vec<u8>>), TemplateError> {
        let meta = self.take(entry, label)?;
        Ok((meta.path, meta.link))
    }

    /// The path, link target and PAX records of `entry`, from what came before it.
    fn take<R: Read>(
        &mut self,
        entry: &tar::Entry<'_, R>,
        label: &str,
    ) -> Result<Meta, TemplateError> {
        let h = entry.header();
        let mut meta = Meta {
            path: self
                .long_name
                .take()
                .unwrap_or_else(|| h.path_bytes().into_owned()),
            link: self
                .long_link
                .take()
                .or_else(|| h.link_name_bytes().map(|l| l.into_owned())),
            mode: h.mode().unwrap_or(0o644) & 0o7777,
            uid: h
                .uid()
                .ok()
                .and_then(|u| u32::try_from(u).ok())
                .unwrap_or(0),
            gid: h
                .gid()
                .ok()
                .and_then(|g| u32::try_from(g).ok())
                .unwrap_or(0),
            mtime: h
                .mtime()
                .map(|t| t.min(i64::MAX as u64) as i64)
                .unwrap_or(0),
            xattrs: Vec::new(),
        };
        let Some(pax) = self.pax.take() else {
            return Ok(meta);
        };
        for ext in tar::PaxExtensions::new(&pax) {
            let ext = ext.map_err(|_| bad(label, "a PAX header is malformed"))?;
            let key = ext.key_bytes();
            let value = ext.value_bytes();
            let number = || {
                std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.split('.').next())
                    .and_then(|v| v.parse::<i64>().ok())
            };
            match key {
                b"path" => meta.path = value.to_vec(),
                b"linkpath" => meta.link = Some(value.to_vec()),
                b"uid" => meta.uid = number().and_then(|n| u32::try_from(n).ok()).unwrap_or(0),
                b"gid" => meta.gid = number().and_then(|n| u32::try_from(n).ok()).unwrap_or(0),
                b"mtime" => meta.mtime = number().unwrap_or(0),
                b"size" if number() != Some(entry.size() as i64) => {
                    return Err(bad(
                        label,
                        "a PAX size record (a file over 8 GB) is not supported",
                    ));
                }
                k if k.starts_with(b"GNU.sparse.") => {
                    return Err(bad(label, "sparse files (GNU.sparse PAX records) are not supported: build the layer without --sparse"));
                }
                k if k.starts_with(b"SCHILY.xattr.") => {
                    meta.xattrs.push((k[13..].to_vec(), value.to_vec()));
                }
                _ => {}
            }
        }
        Ok(meta)
    }
}

fn read_small<R: Read>(
    entry: &mut tar::Entry<'_, R>,
    max: u64,
    what: &str,
    label: &str,
) -> Result<Vec<u8>, TemplateError> {
    if entry.size() > max {
        return Err(bad(
            label,
            format!("{what} of {} bytes (at most {max})", entry.size()),
        ));
    }
    let mut data = Vec::with_capacity(entry.size() as usize);
    entry
        .read_to_end(&mut data)
        .map_err(|e| bad(label, format!("cannot read {what}: {e}")))?;
    Ok(data)
}

/// The components of a path in a layer: leading `/` and `./` dropped, `..` refused.
pub(crate) fn components(path: &[u8], label: &str) -> Result<Vec<Vec<u8>>, TemplateError> {
    let mut out = Vec::new();
    for c in path.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                return Err(bad(
                    label,
                    format!(
                        "the entry {:?} climbs out with `..`: refusing the layer",
                        String::from_utf8_lossy(path)
                    ),
                ))
            }
            c => out.push(c.to_vec()),
        }
    }
    if out.len() > MAX_DEPTH {
        return Err(bad(
            label,
            format!("a path is more than {MAX_DEPTH} directories deep"),
        ));
    }
    Ok(out)
}

fn cstring(bytes: &[u8], label: &str) -> Result<CString, TemplateError> {
    CString::new(bytes).map_err(|_| bad(label, "a name holds a NUL byte"))
}

fn join(comps: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, c) in comps.iter().enumerate() {
        if i > 0 {
            out.push(b'/');
        }
        out.extend_from_slice(c);
    }
    out
}

impl Unpacker {
    /// An unpacker for the (empty or partly built) root filesystem at `rootfs`.
    pub(crate) fn new(rootfs: &Path, limits: ImageLimits) -> Result<Self, TemplateError> {
        let root = sysfd::open_dir_path(rootfs).map_err(io_err("cannot open", rootfs))?;
        let proc_fd = sysfd::open_dir_path(Path::new("/proc/self/fd"))
            .map_err(io_err("cannot open", Path::new("/proc/self/fd")))?;
        Ok(Unpacker {
            root,
            proc_fd,
            limits,
            stream: 0,
            written: 0,
            chown: sys::is_root(),
            this_layer: HashSet::new(),
            parent_cache: None,
        })
    }

    /// Points the unpacker at another root filesystem (the next layer's tree); its running
    /// totals, which the limits bound, carry over.
    pub(crate) fn retarget(&mut self, rootfs: &Path) -> Result<(), TemplateError> {
        self.root = sysfd::open_dir_path(rootfs).map_err(io_err("cannot open", rootfs))?;
        self.parent_cache = None;
        self.this_layer.clear();
        Ok(())
    }

    /// Applies the layer whose raw (possibly compressed) bytes `raw` yields. `diff_id`, when
    /// known (`sha256:<hex>` from the image config), must be the digest of the uncompressed
    /// stream; the stream is read to its end to check it.
    pub(crate) fn apply(
        &mut self,
        raw: impl Read,
        label: &str,
        diff_id: Option<&str>,
    ) -> Result<LayerSummary, TemplateError> {
        let tar = decompress(raw, label)?;
        let limit = self.limits.max_unpacked_bytes.saturating_sub(self.stream);
        let mut metered = Metered::new(tar, limit);
        let result = self.apply_tar(&mut metered, label).and_then(|summary| {
            metered
                .drain()
                .map_err(|e| bad(label, format!("cannot read the layer to its end: {e}")))?;
            Ok(summary)
        });
        self.stream += metered.count;
        self.parent_cache = None;
        self.this_layer.clear();
        if metered.exceeded {
            return Err(self.over_limit());
        }
        let summary = result?;
        if let Some(want) = diff_id {
            let got = metered.digest();
            if got != want {
                return Err(bad(
                    label,
                    format!("the uncompressed layer is {got}, but the image config says {want}: the image is corrupt or was tampered with"),
                ));
            }
        }
        Ok(summary)
    }

    fn over_limit(&self) -> TemplateError {
        too_big(format!(
            "the image unpacks to more than {} bytes (the limit): raise it or use a smaller image",
            self.limits.max_unpacked_bytes
        ))
    }

    fn apply_tar(
        &mut self,
        stream: &mut impl Read,
        label: &str,
    ) -> Result<LayerSummary, TemplateError> {
        let mut archive = tar::Archive::new(stream);
        let entries = archive
            .entries()
            .map_err(|e| bad(label, format!("not a tar stream: {e}")))?
            .raw(true);
        let mut summary = LayerSummary::default();
        let mut pending = Pending::default();
        for entry in entries {
            let mut entry =
                entry.map_err(|e| bad(label, format!("not a valid tar stream: {e}")))?;
            if pending.absorb(&mut entry, label)? {
                continue;
            }
            let meta = pending.take(&entry, label)?;
            self.apply_entry(&mut entry, meta, label, &mut summary)?;
            summary.entries += 1;
        }
        Ok(summary)
    }

    fn apply_entry<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        meta: Meta,
        label: &str,
        summary: &mut LayerSummary,
    ) -> Result<(), TemplateError> {
        use tar::EntryType as T;
        let shown = String::from_utf8_lossy(&meta.path).into_owned();
        let kind = match entry.header().entry_type() {
            T::Regular | T::Continuous => Kind::File,
            T::Directory => Kind::Dir,
            T::Symlink => Kind::Symlink,
            T::Link => Kind::HardLink,
            T::Fifo => Kind::Fifo,
            T::Char | T::Block => {
                return Err(bad(
                    label,
                    format!("{shown:?} is a device node: images may not carry devices (the runtime provides /dev)"),
                ))
            }
            T::GNUSparse => {
                return Err(bad(
                    label,
                    format!("{shown:?} is a GNU sparse file, which is not supported: build the layer without --sparse"),
                ))
            }
            other => {
                return Err(bad(
                    label,
                    format!("{shown:?} has the tar entry type {:?}, which images do not use", other.as_byte() as char),
                ))
            }
        };
        let comps = components(&meta.path, label)?;
        let Some((name, parents)) = comps.split_last() else {
            // The root itself (`./`): it stays as the template makes it.
            return Ok(());
        };
        if let Some(hidden) = name.strip_prefix(b".wh.") {
            return self.whiteout(parents, hidden, label);
        }
        if kind == Kind::File {
            let total = self.written.saturating_add(entry.size());
            if total > self.limits.max_unpacked_bytes {
                return Err(too_big(format!(
                    "{shown:?} is {} bytes, which takes the image over its limit of {} unpacked bytes",
                    entry.size(),
                    self.limits.max_unpacked_bytes
                )));
            }
        }
        let parent = self.parent(parents, label)?;
        let cname = cstring(name, label)?;
        let existing = sysfd::lstatat(parent.as_raw_fd(), &cname).ok();
        let is_dir = |st: &libc::stat| st.st_mode & libc::S_IFMT == libc::S_IFDIR;
        let ctx = |what: &'static str| {
            let shown = shown.clone();
            let label = label.to_string();
            move |e: io::Error| bad(&label, format!("cannot {what} {shown:?}: {e}"))
        };
        match kind {
            Kind::Dir => {
                if !existing.as_ref().is_some_and(is_dir) {
                    if existing.is_some() {
                        self.remove(&parent, &cname, label)?;
                    }
                    sysfd::mkdirat(parent.as_raw_fd(), &cname, 0o700)
                        .map_err(ctx("create the directory"))?;
                }
                let fd = sysfd::openat(
                    parent.as_raw_fd(),
                    &cname,
                    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                    0,
                )
                .map_err(ctx("open the directory"))?;
                let file = File::from(fd);
                self.owner_and_mode(&file, &meta, label)?;
                summary.dropped_xattrs += self.xattrs(&file, &meta, label)?;
            }
            Kind::File => {
                if existing.is_some() {
                    self.remove(&parent, &cname, label)?;
                }
                let fd = sysfd::openat(
                    parent.as_raw_fd(),
                    &cname,
                    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
                    0o600,
                )
                .map_err(ctx("create"))?;
                let mut file = File::from(fd);
                let n = copy_sparse(entry, &mut file).map_err(ctx("write"))?;
                self.written += n;
                summary.bytes += n;
                self.owner_and_mode(&file, &meta, label)?;
                summary.dropped_xattrs += self.xattrs(&file, &meta, label)?;
                let _ = sysfd::futimens(file.as_raw_fd(), &times(meta.mtime));
            }
            Kind::Symlink => {
                let target = meta
                    .link
                    .as_deref()
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| bad(label, format!("the symlink {shown:?} has no target")))?;
                if existing.is_some() {
                    self.remove(&parent, &cname, label)?;
                }
                // Stored as given: only ever followed inside a machine, or by this room
                // inside the root.
                let target = cstring(target, label)?;
                sysfd::symlinkat(&target, parent.as_raw_fd(), &cname)
                    .map_err(ctx("create the symlink"))?;
                self.parent_cache = None;
                self.chown_node(&parent, &cname, &meta, label)?;
                let _ = sysfd::set_times_at(parent.as_raw_fd(), &cname, &times(meta.mtime));
            }
            Kind::HardLink => {
                let target = meta.link.as_deref().unwrap_or_default();
                let tcomps = components(target, label)?;
                if tcomps.is_empty() {
                    return Err(bad(label, format!("the hard link {shown:?} names no file")));
                }
                let tpath = cstring(&join(&tcomps), label)?;
                let src = sysfd::open_in_root(
                    self.root.as_raw_fd(),
                    &tpath,
                    libc::O_PATH | libc::O_NOFOLLOW,
                    0,
                )
                .map_err(|e| {
                    bad(
                        label,
                        format!(
                            "the hard link {shown:?} names {:?}, which is not in the image ({e})",
                            String::from_utf8_lossy(target)
                        ),
                    )
                })?;
                let st = sysfd::fstat(src.as_raw_fd()).map_err(ctx("stat the link target of"))?;
                if is_dir(&st) {
                    return Err(bad(
                        label,
                        format!("the hard link {shown:?} names a directory"),
                    ));
                }
                if let Some(e) = &existing {
                    if (e.st_dev, e.st_ino) == (st.st_dev, st.st_ino) {
                        self.this_layer.insert(join(&comps));
                        return Ok(());
                    }
                    self.remove(&parent, &cname, label)?;
                }
                sysfd::link_fd(
                    self.proc_fd.as_raw_fd(),
                    src.as_raw_fd(),
                    parent.as_raw_fd(),
                    &cname,
                )
                .map_err(ctx("create the hard link"))?;
            }
            Kind::Fifo => {
                if existing.is_some() {
                    self.remove(&parent, &cname, label)?;
                }
                sysfd::mkfifoat(parent.as_raw_fd(), &cname, 0o600)
                    .map_err(ctx("create the fifo"))?;
                self.chown_node(&parent, &cname, &meta, label)?;
                let node = sysfd::openat(
                    parent.as_raw_fd(),
                    &cname,
                    libc::O_PATH | libc::O_NOFOLLOW,
                    0,
                )
                .map_err(ctx("open the fifo"))?;
                sysfd::chmod_via_proc(self.proc_fd.as_raw_fd(), node.as_raw_fd(), meta.mode)
                    .map_err(ctx("set the mode of"))?;
            }
        }
        self.this_layer.insert(join(&comps));
        Ok(())
    }

    /// The directory `comps` (relative to the root, resolved inside it), created with mode
    /// 0755 where missing.
    fn parent(&mut self, comps: &[Vec<u8>], label: &str) -> Result<OwnedFd, TemplateError> {
        let key = join(comps);
        if let Some((k, fd)) = &self.parent_cache {
            if *k == key {
                return fd
                    .try_clone()
                    .map_err(io_err("cannot duplicate", Path::new("/proc/self/fd")));
            }
        }
        let flags = libc::O_PATH | libc::O_DIRECTORY;
        let mut made = false;
        let fd = match sysfd::open_in_root(
            self.root.as_raw_fd(),
            &cstring_or_dot(&key, label)?,
            flags,
            0,
        ) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                let mut dir = self
                    .root
                    .try_clone()
                    .map_err(io_err("cannot duplicate", Path::new("/proc/self/fd")))?;
                for i in 0..comps.len() {
                    let prefix = cstring(&join(&comps[..=i]), label)?;
                    dir = match sysfd::open_in_root(self.root.as_raw_fd(), &prefix, flags, 0) {
                        Ok(fd) => fd,
                        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                            let name = cstring(&comps[i], label)?;
                            match sysfd::mkdirat(dir.as_raw_fd(), &name, 0o755) {
                                Ok(()) => made = true,
                                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
                                Err(e) => return Err(parent_error(label, comps, e)),
                            }
                            sysfd::open_in_root(self.root.as_raw_fd(), &prefix, flags, 0)
                                .map_err(|e| {
                                    if e.raw_os_error() == Some(libc::ENOENT) {
                                        bad(label, format!(
                                            "an entry lies under {:?}, a symlink whose target is not in the image",
                                            String::from_utf8_lossy(&join(&comps[..=i]))
                                        ))
                                    } else {
                                        parent_error(label, comps, e)
                                    }
                                })?
                        }
                        Err(e) => return Err(parent_error(label, comps, e)),
                    };
                }
                dir
            }
            Err(e) => return Err(parent_error(label, comps, e)),
        };
        if made {
            for i in 0..comps.len() {
                self.this_layer.insert(join(&comps[..=i]));
            }
        }
        let copy = fd
            .try_clone()
            .map_err(io_err("cannot duplicate", Path::new("/proc/self/fd")))?;
        self.parent_cache = Some((key, copy));
        Ok(fd)
    }

    fn whiteout(
        &mut self,
        parents: &[Vec<u8>],
        hidden: &[u8],
        label: &str,
    ) -> Result<(), TemplateError> {
        let key = cstring_or_dot(&join(parents), label)?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY;
        let Ok(dir) = sysfd::open_in_root(self.root.as_raw_fd(), &key, flags, 0) else {
            // Nothing below to hide.
            return Ok(());
        };
        if hidden == b".wh..opq" {
            let names = sysfd::read_dir_names(
                dir.try_clone()
                    .map_err(io_err("cannot duplicate", Path::new("/proc/self/fd")))?,
            )
            .map_err(|e| {
                bad(
                    label,
                    format!("cannot list a directory to make it opaque: {e}"),
                )
            })?;
            for name in names {
                let mut path = parents.to_vec();
                path.push(name.to_bytes().to_vec());
                if !self.this_layer.contains(&join(&path)) {
                    self.remove(&dir, &name, label)?;
                }
            }
        } else if hidden.starts_with(b".wh.") || hidden.is_empty() {
            // aufs's own bookkeeping (`.wh..wh.plnk`, `.wh..wh.aufs`): nothing to apply.
        } else {
            let name = cstring(hidden, label)?;
            self.remove(&dir, &name, label)?;
        }
        Ok(())
    }

    /// Removes `name` in `dir` whatever it is (a directory with everything below it);
    /// nothing if it does not exist.
    fn remove(&mut self, dir: &OwnedFd, name: &CStr, label: &str) -> Result<(), TemplateError> {
        self.parent_cache = None;
        remove_at(dir, name, 0).map_err(|e| {
            bad(
                label,
                format!("cannot remove {:?}: {e}", name.to_string_lossy()),
            )
        })
    }

    fn owner_and_mode(&self, file: &File, meta: &Meta, label: &str) -> Result<(), TemplateError> {
        if self.chown {
            sysfd::fchown_empty(file.as_raw_fd(), meta.uid, meta.gid)
                .map_err(|e| bad(label, format!("cannot set the owner: {e}")))?;
        }
        // After chown, which clears setuid and setgid.
        file.set_permissions(Permissions::from_mode(meta.mode))
            .map_err(|e| bad(label, format!("cannot set the mode: {e}")))
    }

    fn chown_node(
        &self,
        parent: &OwnedFd,
        name: &CStr,
        meta: &Meta,
        label: &str,
    ) -> Result<(), TemplateError> {
        if !self.chown {
            return Ok(());
        }
        let node = sysfd::openat(parent.as_raw_fd(), name, libc::O_PATH | libc::O_NOFOLLOW, 0)
            .map_err(|e| {
                bad(
                    label,
                    format!("cannot open {:?}: {e}", name.to_string_lossy()),
                )
            })?;
        sysfd::fchown_empty(node.as_raw_fd(), meta.uid, meta.gid)
            .map_err(|e| bad(label, format!("cannot set the owner: {e}")))
    }

    /// Sets the attributes worth keeping; returns how many were dropped.
    fn xattrs(&self, file: &File, meta: &Meta, label: &str) -> Result<u64, TemplateError> {
        let mut dropped = 0;
        for (name, value) in &meta.xattrs {
            let keep = name.starts_with(b"user.") || name == b"security.capability";
            if !keep || value.len() > MAX_XATTR {
                dropped += 1;
                continue;
            }
            let cname = cstring(name, label)?;
            match locker_sys::xattr::fset(file.as_raw_fd(), &cname, value) {
                Ok(()) => {}
                // A file system without user xattrs: the file itself is what matters.
                Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => dropped += 1,
                Err(e) => {
                    return Err(bad(
                        label,
                        format!(
                            "cannot set the attribute {:?}: {e}",
                            cname.to_string_lossy()
                        ),
                    ))
                }
            }
        }
        Ok(dropped)
    }
}

fn cstring_or_dot(path: &[u8], label: &str) -> Result<CString, TemplateError> {
    if path.is_empty() {
        Ok(c".".to_owned())
    } else {
        cstring(path, label)
    }
}

fn parent_error(label: &str, comps: &[Vec<u8>], e: io::Error) -> TemplateError {
    let path = String::from_utf8_lossy(&join(comps)).into_owned();
    if e.raw_os_error() == Some(libc::ENOTDIR) {
        bad(
            label,
            format!("{path:?} is not a directory, yet an entry lies under it"),
        )
    } else {
        bad(label, format!("cannot open the directory {path:?}: {e}"))
    }
}

fn times(mtime: i64) -> [libc::timespec; 2] {
    let t = libc::timespec {
        tv_sec: mtime as libc::time_t,
        tv_nsec: 0,
    };
    [t, t]
}

/// Removes `name` under `dir` and everything below it, never following a symlink.
fn remove_at(dir: &OwnedFd, name: &CStr, depth: usize) -> io::Result<()> {
    match sysfd::unlinkat(dir.as_raw_fd(), name, 0) {
        Ok(()) => return Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EISDIR) => {}
        Err(e) => return Err(e),
    }
    if depth > MAX_DEPTH + 1 {
        return Err(io::Error::other("directory tree too deep"));
    }
    let sub = sysfd::openat(
        dir.as_raw_fd(),
        name,
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        0,
    )?;
    let names = sysfd::read_dir_names(sub.try_clone()?)?;
    for child in names {
        remove_at(&sub, &child, depth + 1)?;
    }
    sysfd::unlinkat(dir.as_raw_fd(), name, libc::AT_REMOVEDIR)
}

/// Copies an entry's data, leaving holes where whole chunks are zero; returns its size.
fn copy_sparse(from: &mut impl Read, to: &mut File) -> io::Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    let mut hole = false;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == CHUNK && buf.iter().all(|b| *b == 0) {
            to.seek(SeekFrom::Current(n as i64))?;
            hole = true;
        } else {
            to.write_all(&buf[..n])?;
            hole = false;
        }
        total += n as u64;
    }
    if hole {
        to.set_len(total)?;
    }
    Ok(total)
}
