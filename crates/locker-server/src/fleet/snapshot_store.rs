//! The snapshot store's files (`--snapshot-store DIR`, `restart`): the bundles of kept
//! snapshots, stored once per distinct piece.
//!
//! A sandbox's snapshots differ from one another by what it wrote between them, and the
//! sandboxes of one template share most of their bytes; a copy of each whole bundle would
//! cost the store the sum of them all. So a bundle is cut into pieces where its content says
//! (content-defined chunking: a rolling gear hash over the bytes, a cut where its low bits
//! are zero, between [`MIN`] and [`MAX`] bytes, [`AVG`] on average), each piece is kept once
//! under its SHA-256 (`DIR/chunks/<2 hex>/<64 hex>`), and the snapshot is a manifest naming
//! its pieces in order (`DIR/<snap>.chunks`: `LOCKER-CHUNKS 1`, then `<hex> <length>` a
//! line). Bytes inserted or removed early in a bundle (its header line grows) move only the
//! cuts near them: the rest of the pieces are the same.
//!
//! - **Writing** ([`put`]): pieces first (each written aside, then renamed; the store's
//!   filesystem synced once), then the manifest (aside, synced, renamed, dated when the
//!   snapshot was taken: a sandbox's newest is found by that date). A manifest there names
//!   only pieces that are there.
//! - **Reading** ([`Kept::body`], [`Kept::reader`]): the pieces in order, each checked
//!   against its hash as it is read (a damaged piece fails the read; nothing half-checked
//!   reaches a node).
//! - **Letting go** ([`forget`], [`sweep_pieces`], [`sweep`]): a manifest is removed; a
//!   piece no manifest names is removed by the sweep. Writers hold a shared `flock` on `DIR/.lock` while they write,
//!   the sweep an exclusive one that it only tries for (a busy store is swept the next
//!   time), so no piece a write is about to name is removed under it; several control
//!   replicas sharing the store (NFS v4, CephFS: both lock) keep that between them.
//! - A store written by an earlier release holds whole bundles (`DIR/<snap>.carry`): they
//!   are read as they are and let go the same way.
//!
//! Owns the files under the store's directory; what a bundle holds is `carry`'s, which
//! snapshots are kept and when is `restart`'s.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufRead, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::SystemTime;

use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};

/// A piece's smallest length (but a bundle's last).
pub const MIN: usize = 16 << 10;
/// A piece's length on average past [`MIN`] (a power of two: the cut mask's). Small enough
/// that changes scattered over a disk or a memory image (a few 4 KiB blocks here and there)
/// leave most pieces as they were; large enough that a GiB is some 15,000 files.
pub const AVG: usize = 64 << 10;
/// A piece's largest length.
pub const MAX: usize = 256 << 10;
const MANIFEST_MAGIC: &str = "LOCKER-CHUNKS 1";
const MANIFEST: &str = ".chunks";
/// A bundle an earlier release kept whole.
const WHOLE: &str = ".carry";
const CHUNKS: &str = "chunks";
const LOCK: &str = ".lock";
/// Pieces a manifest may name (a bundle is bounded by its sandbox's disk and memory: this is
/// far above any).
const PIECES_MAX: usize = 1 << 22;

/// The gear table: a fixed pseudo-random value per byte (splitmix64 from a fixed seed).
/// Fixed for good: it decides where pieces are cut, so a new table would share no piece
/// with the store's (nothing breaks, nothing dedups).
fn gear() -> &'static [u64; 256] {
    static GEAR: OnceLock<[u64; 256]> = OnceLock::new();
    GEAR.get_or_init(|| {
        let mut t = [0u64; 256];
        let mut x: u64 = 0x4c4f_434b_4552_2131;
        for v in &mut t {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            *v = z ^ (z >> 31);
        }
        t
    })
}

/// Where the first piece of `data` ends: a content-defined cut, else [`MAX`], else (less than
/// `MAX` bytes and no cut) `None`: more bytes are needed, or at the end it is all one piece.
fn cut(data: &[u8]) -> Option<usize> {
    let mask = (AVG as u64 - 1) << (64 - AVG.trailing_zeros());
    let g = gear();
    let end = data.len().min(MAX);
    let mut h = 0u64;
    // The hash remembers the last 64 bytes only: start 64 before the first place a cut may be.
    for (i, &b) in data[..end].iter().enumerate().skip(MIN.saturating_sub(64)) {
        h = (h << 1).wrapping_add(g[b as usize]);
        if i + 1 >= MIN && h & mask == 0 {
            return Some(i + 1);
        }
    }
    (data.len() >= MAX).then_some(MAX)
}

fn is_hash(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn piece_path(dir: &Path, hash: &str) -> PathBuf {
    dir.join(CHUNKS).join(&hash[..2]).join(hash)
}

fn manifest_path(dir: &Path, snap: &str) -> PathBuf {
    dir.join(format!("{snap}{MANIFEST}"))
}

/// The store's lock, taken shared (writers) or tried exclusive (the sweep: `None` when busy).
fn lock(dir: &Path, exclusive: bool) -> io::Result<Option<File>> {
    std::fs::create_dir_all(dir)?;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(dir.join(LOCK))?;
    if exclusive {
        return Ok(locker_sys::fs::flock(&f, false)?.then_some(f));
    }
    locker_sys::fs::lock_shared(&f)?;
    Ok(Some(f))
}

/// What a [`put`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Put {
    /// The bundle's length.
    pub bytes: u64,
    /// Of those, the bytes of pieces the store did not hold yet.
    pub new_bytes: u64,
    pub pieces: usize,
}

/// Keeps the bundle `body` of snapshot `snap` in the store `dir`, dated `taken` (see the
/// module doc). Nothing of it is named by a manifest unless all of it was written.
pub async fn put<S, E>(dir: &Path, snap: &str, body: S, taken: SystemTime) -> io::Result<Put>
where
    S: Stream<Item = Result<Bytes, E>>,
    E: std::fmt::Display,
{
    let d = dir.to_path_buf();
    let held = tokio::task::spawn_blocking(move || lock(&d, false))
        .await
        .map_err(io::Error::other)??;
    let mut put = Put {
        bytes: 0,
        new_bytes: 0,
        pieces: 0,
    };
    let mut lines = format!("{MANIFEST_MAGIC}\n");
    let mut buf = BytesMut::new();
    let mut body = std::pin::pin!(body);
    let mut ended = false;
    while !ended || !buf.is_empty() {
        if !ended && buf.len() < MAX {
            match body
                .try_next()
                .await
                .map_err(|e| io::Error::other(e.to_string()))?
            {
                Some(b) => buf.extend_from_slice(&b),
                None => ended = true,
            }
            continue;
        }
        let n = cut(&buf).unwrap_or(buf.len());
        let piece = buf.split_to(n).freeze();
        let d = dir.to_path_buf();
        let (hash, fresh) = tokio::task::spawn_blocking(move || write_piece(&d, &piece))
            .await
            .map_err(io::Error::other)??;
        lines.push_str(&format!("{hash} {n}\n"));
        put.bytes += n as u64;
        put.pieces += 1;
        if fresh {
            put.new_bytes += n as u64;
        }
        if put.pieces > PIECES_MAX {
            return Err(io::Error::other(
                "a bundle of more pieces than a store keeps",
            ));
        }
    }
    let (d, snap) = (dir.to_path_buf(), snap.to_owned());
    tokio::task::spawn_blocking(move || {
        // The pieces reach the disk before a manifest names them.
        locker_sys::fs::syncfs(&File::open(&d)?)?;
        let part = d.join(format!(".{snap}{MANIFEST}.part"));
        let written = write_aside(
            &part,
            &manifest_path(&d, &snap),
            lines.as_bytes(),
            Some(taken),
        );
        drop(held);
        written
    })
    .await
    .map_err(io::Error::other)??;
    Ok(put)
}

/// Writes `piece` under its hash unless it is there: (its hash, whether it was new).
fn write_piece(dir: &Path, piece: &[u8]) -> io::Result<(String, bool)> {
    let hash = locker_sys::hex::encode(&Sha256::digest(piece));
    let path = piece_path(dir, &hash);
    if path.exists() {
        return Ok((hash, false));
    }
    let parent = path.parent().expect("a piece has a directory");
    std::fs::create_dir_all(parent)?;
    // Unique per write: two writes of one piece at once (two snapshots sharing it) each
    // write their own part; the second rename replaces the first with the same bytes.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let part = parent.join(format!(".{hash}.{}.{n}.part", std::process::id()));
    write_aside(&part, &path, piece, None).map(|()| (hash, true))
}

/// Writes `data` into `part` (mode 0600), then renames it to `path`, so that `path` is whole
/// or absent; `part` is removed on failure. `dated`: synced first, and dated so.
fn write_aside(part: &Path, path: &Path, data: &[u8], dated: Option<SystemTime>) -> io::Result<()> {
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(part)?;
        f.write_all(data)?;
        if let Some(t) = dated {
            f.sync_all()?;
            f.set_modified(t)?;
        }
        std::fs::rename(part, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(part);
    }
    written
}

/// A kept snapshot: where it is and when it was taken.
#[derive(Debug, Clone)]
pub struct Kept {
    pub snap: String,
    pub taken: SystemTime,
    form: Form,
}

#[derive(Debug, Clone)]
enum Form {
    /// A manifest (the store's directory, the manifest's path), read when the copy is.
    Pieces(PathBuf, PathBuf),
    /// A whole bundle (an earlier release's).
    Whole(PathBuf),
}

/// Snapshot `snap`'s copy in the store `dir`, if there is one (one `stat`: the manifest is
/// read, and checked, with the copy).
pub fn find(dir: &Path, snap: &str) -> Option<Kept> {
    let m = manifest_path(dir, snap);
    if let Ok(taken) = std::fs::metadata(&m).and_then(|m| m.modified()) {
        return Some(Kept {
            snap: snap.to_owned(),
            taken,
            form: Form::Pieces(dir.to_path_buf(), m),
        });
    }
    let w = dir.join(format!("{snap}{WHOLE}"));
    let taken = std::fs::metadata(&w).and_then(|m| m.modified()).ok()?;
    Some(Kept {
        snap: snap.to_owned(),
        taken,
        form: Form::Whole(w),
    })
}

fn read_manifest(f: File) -> io::Result<Vec<(String, u64)>> {
    let mut lines = io::BufReader::new(f).lines();
    if lines.next().transpose()?.as_deref() != Some(MANIFEST_MAGIC) {
        return Err(io::Error::other("not a manifest of the snapshot store"));
    }
    let mut out = Vec::new();
    for line in lines {
        let line = line?;
        let (hash, len) = line
            .split_once(' ')
            .and_then(|(h, l)| Some((h, l.parse::<u64>().ok()?)))
            .filter(|(h, l)| is_hash(h) && (1..=MAX as u64).contains(l))
            .ok_or_else(|| io::Error::other(format!("a bad line in a manifest: {line:?}")))?;
        out.push((hash.to_owned(), len));
        if out.len() > PIECES_MAX {
            return Err(io::Error::other("a manifest of too many pieces"));
        }
    }
    Ok(out)
}

/// Reads one piece whole and checks it against its hash and length.
fn read_piece(dir: &Path, hash: &str, len: u64) -> io::Result<Vec<u8>> {
    let data = std::fs::read(piece_path(dir, hash))?;
    if data.len() as u64 != len || locker_sys::hex::encode(&Sha256::digest(&data)) != hash {
        return Err(io::Error::other(format!(
            "piece {hash} of the snapshot store is damaged"
        )));
    }
    Ok(data)
}

impl Kept {
    /// The bundle as a blocking reader (its header is all a caller reads this way).
    pub fn reader(&self) -> io::Result<Box<dyn Read + Send>> {
        match &self.form {
            Form::Whole(p) => Ok(Box::new(File::open(p)?)),
            Form::Pieces(dir, m) => Ok(Box::new(PieceReader {
                dir: dir.clone(),
                pieces: read_manifest(File::open(m)?)?.into_iter(),
                current: io::Cursor::new(Vec::new()),
            })),
        }
    }

    /// The bundle as a stream of bytes (the body sent to a node).
    pub async fn body(&self) -> io::Result<axum::body::Body> {
        match &self.form {
            Form::Whole(p) => {
                let file = tokio::fs::File::open(p).await?;
                Ok(axum::body::Body::from_stream(
                    tokio_util::io::ReaderStream::with_capacity(file, 1 << 20),
                ))
            }
            Form::Pieces(dir, m) => {
                let dir = dir.clone();
                let m = m.clone();
                let pieces = tokio::task::spawn_blocking(move || read_manifest(File::open(m)?))
                    .await
                    .map_err(io::Error::other)??;
                let stream = futures_util::stream::iter(pieces).then(move |(h, len)| {
                    let dir = dir.clone();
                    async move {
                        tokio::task::spawn_blocking(move || read_piece(&dir, &h, len))
                            .await
                            .map_err(io::Error::other)?
                            .map(Bytes::from)
                    }
                });
                Ok(axum::body::Body::from_stream(stream))
            }
        }
    }
}

/// A manifest's pieces read in order, each checked.
struct PieceReader {
    dir: PathBuf,
    pieces: std::vec::IntoIter<(String, u64)>,
    current: io::Cursor<Vec<u8>>,
}

impl Read for PieceReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        loop {
            let n = self.current.read(out)?;
            if n > 0 || out.is_empty() {
                return Ok(n);
            }
            let Some((hash, len)) = self.pieces.next() else {
                return Ok(0);
            };
            self.current = io::Cursor::new(read_piece(&self.dir, &hash, len)?);
        }
    }
}

/// Lets go of snapshot `snap`'s copy (its manifest, or its whole bundle); its pieces stay
/// until [`sweep_pieces`].
pub fn forget(dir: &Path, snap: &str) {
    let _ = std::fs::remove_file(manifest_path(dir, snap));
    let _ = std::fs::remove_file(dir.join(format!("{snap}{WHOLE}")));
}

/// Removes the pieces no manifest names (a [`sweep`] that keeps every copy), unless a write
/// holds the store: then the next sweep does.
pub fn sweep_pieces(dir: &Path) {
    if let Err(e) = sweep(dir, |_| true, std::time::Duration::MAX) {
        tracing::warn!(error = %e, "the snapshot store could not be swept");
    }
}

/// What a sweep let go of.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    pub copies: usize,
    pub pieces: usize,
    pub bytes: u64,
    /// Another writer held the store: nothing was swept this time.
    pub busy: bool,
}

/// Removes the copies whose snapshot `keep` says no longer exists and that are older than
/// `older_than` (another replica may be writing a newer one), leftovers of writes that
/// died (older than that too), and every piece no manifest names. Skipped (`busy`) while
/// a write holds the store.
pub fn sweep(
    dir: &Path,
    keep: impl Fn(&str) -> bool,
    older_than: std::time::Duration,
) -> io::Result<Swept> {
    let mut swept = Swept::default();
    if !dir.is_dir() {
        return Ok(swept);
    }
    let Some(_held) = lock(dir, true)? else {
        swept.busy = true;
        return Ok(swept);
    };
    let old = |p: &Path| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().unwrap_or_default() > older_than)
    };
    let mut named = HashSet::new();
    for e in std::fs::read_dir(dir)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        let snap = name
            .strip_suffix(MANIFEST)
            .or_else(|| name.strip_suffix(WHOLE));
        let leftover = name.starts_with('.') && name.ends_with(".part");
        if (leftover || snap.is_some_and(|s| !keep(s))) && old(&path) {
            if std::fs::remove_file(&path).is_ok() {
                swept.copies += usize::from(!leftover);
            }
            continue;
        }
        if name.ends_with(MANIFEST) {
            // A manifest that cannot be read names nothing for sure: keep its pieces.
            match File::open(&path).and_then(read_manifest) {
                Ok(p) => named.extend(p.into_iter().map(|(h, _)| h)),
                Err(e) => {
                    return Err(io::Error::other(format!("{}: {e}", path.display())));
                }
            }
        }
    }
    // No writer holds the store: every piece is named by a manifest or by nothing.
    for sub in std::fs::read_dir(dir.join(CHUNKS))
        .into_iter()
        .flatten()
        .flatten()
    {
        for e in std::fs::read_dir(sub.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if named.contains(&name) {
                continue;
            }
            let len = e.metadata().map(|m| m.len()).unwrap_or(0);
            if std::fs::remove_file(e.path()).is_ok() && is_hash(&name) {
                swept.pieces += 1;
                swept.bytes += len;
            }
        }
    }
    Ok(swept)
}

/// The bytes the store's pieces take (what a sweep would count).
#[cfg(test)]
fn pieces_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir.join(CHUNKS))
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|sub| {
            std::fs::read_dir(sub.path())
                .into_iter()
                .flatten()
                .flatten()
        })
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic bytes that look random (xorshift), `n` of them from `seed`.
    fn noise(seed: u64, n: usize) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn stream(data: Vec<u8>) -> impl Stream<Item = Result<Bytes, io::Error>> {
        // Uneven frames, as a body arrives.
        let frames: Vec<Result<Bytes, io::Error>> = data
            .chunks(77_777)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        futures_util::stream::iter(frames)
    }

    fn read_all(k: &Kept) -> Vec<u8> {
        let mut out = Vec::new();
        k.reader().unwrap().read_to_end(&mut out).unwrap();
        out
    }

    #[test]
    fn cuts_follow_the_content_and_stay_within_bounds() {
        let data = noise(7, 8 << 20);
        let mut at = 0;
        let mut lens = Vec::new();
        while at < data.len() {
            let n = cut(&data[at..]).unwrap_or(data.len() - at);
            lens.push(n);
            at += n;
        }
        assert!(lens[..lens.len() - 1]
            .iter()
            .all(|&n| (MIN..=MAX).contains(&n)));
        let avg = data.len() / lens.len();
        assert!((AVG / 2..=AVG * 2).contains(&avg), "average piece {avg}");
        // Zeros (a disk's unused journal) are cut at MAX, all alike.
        assert_eq!(cut(&vec![0u8; 3 << 20]), Some(MAX));
        // Too little to decide.
        assert_eq!(cut(&data[..MIN - 1]), None);
    }

    #[tokio::test]
    async fn a_bundle_comes_back_as_it_went_and_a_similar_one_costs_only_its_difference() {
        let tmp = locker_tests_tmp();
        let dir = tmp.path();
        let first = noise(1, 6 << 20);
        let taken = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        let a = put(dir, "snap_a", stream(first.clone()), taken)
            .await
            .unwrap();
        assert_eq!(
            (a.bytes, a.new_bytes),
            (first.len() as u64, first.len() as u64)
        );
        let k = find(dir, "snap_a").unwrap();
        assert_eq!(k.taken, taken);
        assert_eq!(read_all(&k), first);
        // The same bundle with a longer header and 100 KiB changed in the middle.
        let mut second = b"a header line that grew\n".to_vec();
        second.extend_from_slice(&first);
        second[3 << 20..(3 << 20) + 100_000].copy_from_slice(&noise(2, 100_000));
        let b = put(dir, "snap_b", stream(second.clone()), SystemTime::now())
            .await
            .unwrap();
        assert!(
            b.new_bytes < 8 * MAX as u64,
            "{b:?}: more than the pieces around the two changes"
        );
        assert!(pieces_bytes(dir) < first.len() as u64 + 8 * MAX as u64);
        let body = find(dir, "snap_b").unwrap().body().await.unwrap();
        let got = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        assert_eq!(got.as_ref(), second.as_slice());

        // Letting go of one keeps the other whole; the pieces only it named go.
        forget(dir, "snap_a");
        sweep_pieces(dir);
        assert!(find(dir, "snap_a").is_none());
        assert_eq!(read_all(&find(dir, "snap_b").unwrap()), second);
        assert!(pieces_bytes(dir) < second.len() as u64 + MAX as u64);
        forget(dir, "snap_b");
        sweep_pieces(dir);
        assert_eq!(pieces_bytes(dir), 0);
    }

    #[tokio::test]
    async fn a_damaged_piece_fails_the_read_and_a_busy_store_is_not_swept() {
        let tmp = locker_tests_tmp();
        let dir = tmp.path();
        let data = noise(3, 2 << 20);
        put(dir, "snap_c", stream(data.clone()), SystemTime::now())
            .await
            .unwrap();
        let pieces = read_manifest(File::open(manifest_path(dir, "snap_c")).unwrap()).unwrap();
        let victim = piece_path(dir, &pieces[1].0);
        let mut bytes = std::fs::read(&victim).unwrap();
        bytes[10] ^= 1;
        std::fs::write(&victim, bytes).unwrap();
        let mut out = Vec::new();
        let e = find(dir, "snap_c")
            .unwrap()
            .reader()
            .unwrap()
            .read_to_end(&mut out)
            .unwrap_err();
        assert!(e.to_string().contains("damaged"), "{e}");

        // A writer holds the store: the sweep leaves it; then it sweeps what no manifest
        // names (a stray piece) and the copies of snapshots that are gone.
        let stray = piece_path(dir, &"ab".repeat(32));
        std::fs::create_dir_all(stray.parent().unwrap()).unwrap();
        std::fs::write(&stray, b"x").unwrap();
        let writer = lock(dir, false).unwrap();
        let s = sweep(dir, |_| false, std::time::Duration::ZERO).unwrap();
        assert!(s.busy && stray.exists(), "{s:?}");
        drop(writer);
        let s = sweep(dir, |s| s == "snap_c", std::time::Duration::ZERO).unwrap();
        assert_eq!((s.copies, s.pieces, s.busy), (0, 1, false), "{s:?}");
        assert!(!stray.exists() && find(dir, "snap_c").is_some());
        let s = sweep(dir, |_| false, std::time::Duration::ZERO).unwrap();
        assert_eq!(s.copies, 1, "{s:?}");
        assert_eq!(pieces_bytes(dir), 0);
    }

    #[test]
    fn a_whole_bundle_of_an_earlier_release_is_read_and_let_go() {
        let tmp = locker_tests_tmp();
        let dir = tmp.path();
        std::fs::write(dir.join("snap_old.carry"), b"LOCKER-CARRY 1\n{}\n").unwrap();
        assert_eq!(
            read_all(&find(dir, "snap_old").unwrap()),
            b"LOCKER-CARRY 1\n{}\n"
        );
        forget(dir, "snap_old");
        assert!(find(dir, "snap_old").is_none());
    }

    /// A temporary directory of its own per test, removed on drop.
    fn locker_tests_tmp() -> Tmp {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let p = std::env::temp_dir().join(format!("locker-snapstore-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Tmp(p)
    }

    struct Tmp(PathBuf);
    impl Tmp {
        fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
