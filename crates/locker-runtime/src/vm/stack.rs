//! A microVM machine's disk chain on the host (the image QEMU writes and the read-only
//! layers beneath it), and the zero-copy point of a memory snapshot that moves it.
//!
//! A machine starts with its chain given by its directory's names (see the module doc of
//! [`super`], "Disks"): `disk.img` alone, or `disk.qcow2` over `layers/<n>.<ext>`; QEMU's
//! node for the image it writes is `disk`. A **point** ([`point`], QMP `blockdev-snapshot`
//! while the VM is stopped for a memory snapshot) gives QEMU a new blank overlay
//! (`disk-<n>.qcow2`, node `disk-<n>`) above the image it wrote, which becomes a read-only
//! layer: root's, mode 0444, hard-linked into the snapshot as its own image instead of
//! copied. From then on the chain is recorded in `disk.json` in the machine's directory
//! (written before anything else reads it, atomically), so a restarted server, which
//! adopts the running QEMU, knows what it writes and what it stands on; files are never
//! renamed under QEMU, so its node names and file names stay true.
//!
//! A point makes the machine's own chain one layer deeper, so it is taken only when it
//! saves a copy worth having (the image written holds at least [`POINT_MIN_BYTES`]) and
//! leaves the machine room below [`crate::disk::MAX_LAYERS`]; otherwise the snapshot copies
//! the image, which keeps the machine's chain as it is.
//!
//! The record lives in a directory the machine's QEMU owns, so it is read as untrusted:
//! every name must be one this room gives (no path leaves the directory), and the layers
//! must pass [`crate::disk::check_vm_stack`] (root's regular files) before a snapshot
//! links them.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::qmp::Qmp;
use super::{setup, VmError};
use crate::disk::{Format, MACHINE_LAYERS};

/// The record of a machine's chain once a point moved it.
pub const RECORD: &str = "disk.json";
/// The least a machine's written image must hold for a snapshot to take it as a layer
/// rather than copy it (a copy of less costs milliseconds and keeps the chain short).
pub const POINT_MIN_BYTES: u64 = 32 << 20;

/// A machine's disk chain, as names relative to its directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chain {
    /// The image QEMU writes.
    pub top: String,
    /// QEMU's node name for it (the device's).
    pub node: String,
    /// The read-only layers beneath it, top first.
    pub layers: Vec<String>,
}

impl Chain {
    /// The chain of the machine in `dir`: its record if a point wrote one, else what its
    /// directory's names say. An overlay the chain does not name (a server killed between
    /// a point's switch and its record) makes it unknown: an error, never a wrong chain.
    pub fn load(dir: &Path) -> io::Result<Chain> {
        let c = match fs::read(dir.join(RECORD)) {
            Ok(b) => {
                let c: Chain = serde_json::from_slice(&b).map_err(io::Error::other)?;
                c.validate()?;
                c
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Self::by_names(dir)?,
            Err(e) => return Err(e),
        };
        for e in fs::read_dir(dir)?.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if own_name(&name) && name.starts_with("disk-") && !c.names(&name) {
                return Err(io::Error::other(format!(
                    "the machine's disk chain is unknown: {name} is in no record"
                )));
            }
        }
        Ok(c)
    }

    /// Whether the chain names `name`.
    fn names(&self, name: &str) -> bool {
        self.top == name || self.layers.iter().any(|l| l == name)
    }

    /// The chain a machine starts with: `disk.qcow2` over `layers/`, or `disk.img`.
    fn by_names(dir: &Path) -> io::Result<Chain> {
        let found = crate::disk::vm_machine_layers(dir);
        crate::disk::check_numbered_from(&found, 0)?;
        let layers: Vec<String> = found
            .iter()
            .filter_map(|p| p.file_name()?.to_str().map(str::to_owned))
            .map(|n| format!("{MACHINE_LAYERS}/{n}"))
            .collect();
        let top = if layers.is_empty() {
            "disk.img"
        } else {
            "disk.qcow2"
        };
        Ok(Chain {
            top: top.to_owned(),
            node: "disk".to_owned(),
            layers,
        })
    }

    /// The image QEMU writes, in `dir`.
    pub fn top_path(&self, dir: &Path) -> PathBuf {
        dir.join(&self.top)
    }

    /// The layers, top first, in `dir`.
    pub fn layer_paths(&self, dir: &Path) -> Vec<PathBuf> {
        self.layers.iter().map(|l| dir.join(l)).collect()
    }

    /// Refuses a record with a name this room never gives.
    fn validate(&self) -> io::Result<()> {
        let node_ok = self.node == "disk"
            || self
                .node
                .strip_prefix("disk-")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        let mut names: Vec<&str> = vec![&self.top];
        names.extend(self.layers.iter().map(String::as_str));
        let unique = names
            .iter()
            .enumerate()
            .all(|(i, n)| !names[..i].contains(n));
        if !node_ok
            || !own_name(&self.top)
            || !self.layers.iter().all(|l| own_name(l) || layer_name(l))
            || !unique
        {
            return Err(io::Error::other(format!(
                "the machine's {RECORD} names what no host wrote: {self:?}"
            )));
        }
        Ok(())
    }

    /// Writes the record (atomically: a temporary file renamed over it).
    fn store(&self, dir: &Path) -> io::Result<()> {
        let tmp = dir.join(format!(".{RECORD}.tmp"));
        let _ = fs::remove_file(&tmp);
        fs::write(&tmp, serde_json::to_vec(self).expect("a chain serializes"))?;
        fs::File::open(&tmp)?.sync_all()?;
        fs::rename(&tmp, dir.join(RECORD))
    }

    /// The number the next overlay gets (`disk-<n>.qcow2`).
    fn next_number(&self) -> u64 {
        std::iter::once(&self.top)
            .chain(&self.layers)
            .filter_map(|n| {
                n.strip_prefix("disk-")?
                    .strip_suffix(".qcow2")?
                    .parse()
                    .ok()
            })
            .max()
            .unwrap_or(0)
            + 1
    }
}

/// A name of an image a machine writes: `disk.img`, `disk.qcow2` or `disk-<n>.qcow2`.
fn own_name(n: &str) -> bool {
    n == "disk.img"
        || n == "disk.qcow2"
        || n.strip_prefix("disk-")
            .and_then(|r| r.strip_suffix(".qcow2"))
            .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

/// A name of a layer linked at start: `layers/<n>.img` or `layers/<n>.qcow2`.
fn layer_name(n: &str) -> bool {
    n.strip_prefix(MACHINE_LAYERS)
        .and_then(|r| r.strip_prefix('/'))
        .and_then(|r| r.strip_suffix(".img").or_else(|| r.strip_suffix(".qcow2")))
        .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether a snapshot of a machine with `chain` in `dir` should take its written image as
/// a layer (a point) rather than copy it (see the module doc).
pub(super) fn wants_point(dir: &Path, chain: &Chain) -> bool {
    chain.layers.len() + 2 <= crate::disk::MAX_LAYERS
        && crate::disk::allocated_bytes(&chain.top_path(dir)) >= POINT_MIN_BYTES
}

/// A new blank overlay for the point of a machine with `chain` in `dir`, made before its
/// VM is stopped: the file (the machine's uid's) and its node name.
pub(super) fn prepare_point(
    dir: &Path,
    uid: u32,
    chain: &Chain,
) -> Result<(String, String), VmError> {
    let n = chain.next_number();
    let (name, node) = (format!("disk-{n}.qcow2"), format!("disk-{n}"));
    // Every image of the chain has the virtual size of its raw bottom.
    let bottom = chain
        .layer_paths(dir)
        .pop()
        .unwrap_or_else(|| chain.top_path(dir));
    let size = fs::symlink_metadata(&bottom)
        .map_err(setup("read the disk's size"))?
        .len();
    let path = dir.join(&name);
    crate::disk::make_qcow2_from_blank(&path, size, &crate::machine::blank_disks_dir())
        .map_err(setup("make the next overlay"))?;
    std::os::unix::fs::chown(&path, Some(uid), Some(uid)).map_err(setup("chown the overlay"))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
        .map_err(setup("chmod the overlay"))?;
    Ok((name, node))
}

/// The point, while the VM is stopped: QEMU opens the overlay `name` (node `node`, from
/// [`prepare_point`]) with no backing and makes it the device's image above the one it
/// wrote (`blockdev-snapshot`); the chain is recorded; the image written becomes root's
/// and read-only to all (QEMU keeps reading it through its open file). Returns the new
/// chain, whose first layer is the former image, or `None` when QEMU refused before the
/// switch (logged; the overlay is removed and the machine is as it was: the snapshot
/// copies instead). An error after the switch (the record or the former image's owner
/// could not be written) fails the snapshot.
pub(super) fn point(
    q: &mut Qmp,
    dir: &Path,
    chain: &Chain,
    name: &str,
    node: &str,
) -> Result<Option<Chain>, VmError> {
    let path = dir.join(name);
    let added = q.cmd(
        "blockdev-add",
        json!({"driver": "qcow2", "node-name": node, "discard": "unmap", "backing": null,
               "file": {"driver": "file", "filename": path, "discard": "unmap"}}),
    );
    let switched = added.and_then(|_| {
        q.cmd(
            "blockdev-snapshot",
            json!({"node": chain.node, "overlay": node}),
        )
        .inspect_err(|_| {
            let _ = q.cmd("blockdev-del", json!({"node-name": node}));
        })
    });
    if let Err(e) = switched {
        tracing::warn!(dir = %dir.display(), error = %e, "no zero-copy point: the snapshot copies the disk");
        let _ = fs::remove_file(&path);
        return Ok(None);
    }
    let moved = Chain {
        top: name.to_owned(),
        node: node.to_owned(),
        layers: std::iter::once(chain.top.clone())
            .chain(chain.layers.iter().cloned())
            .collect(),
    };
    moved
        .store(dir)
        .map_err(setup("record the machine's disk chain"))?;
    let former = chain.top_path(dir);
    std::os::unix::fs::chown(&former, Some(0), Some(0))
        .map_err(setup("give the former image to root"))?;
    fs::set_permissions(&former, fs::Permissions::from_mode(0o444))
        .map_err(setup("make the former image read-only"))?;
    Ok(Some(moved))
}

/// The file name a snapshot gives the image `top` of a machine: `disk.<ext>` by its
/// format.
/// Writes the disk that the machine in `dir` with `chain` stands on and writes (its
/// image and every layer) into one raw image `out`, sparse (`qemu-img convert`, which
/// skips what reads as zeros), for a snapshot of a machine that stands on as many layers
/// as a snapshot may hold: the snapshot then holds that image alone, as one of a machine
/// restored from a base does, and its children stand on one layer. The machine's QEMU
/// must have let go of the images (stopped, its state migrated).
///
/// `qemu-img` runs as root and interprets qcow2 headers, so it never opens a file in the
/// machine's directory (its QEMU's uid owns it and could put a symlink or a crafted image
/// there): the image QEMU wrote is copied (never through a symlink) and the layers linked
/// into `stage`, a directory of root's beside `out`, and every one checked there as a
/// snapshot's stack is ([`crate::disk::check_vm_images`]: regular, root's, no external
/// data file); `stage` is removed after.
pub(super) fn flatten(dir: &Path, chain: &Chain, out: &Path, stage: &Path) -> Result<(), VmError> {
    let r = flatten_staged(dir, chain, out, stage);
    let _ = fs::remove_dir_all(stage);
    r
}

fn flatten_staged(dir: &Path, chain: &Chain, out: &Path, stage: &Path) -> Result<(), VmError> {
    fs::create_dir(stage).map_err(setup("make the flattening's stage"))?;
    let top = stage.join(snapshot_name(&chain.top_path(dir)));
    crate::disk::copy_ephemeral(&chain.top_path(dir), &top)
        .map_err(setup("copy the machine's image"))?;
    let lower = stage.join(crate::disk::SNAPSHOT_LOWERS);
    crate::disk::link_vm_stack(&chain.layer_paths(dir), &lower, 1)
        .map_err(setup("link the machine's layers"))?;
    let mut paths = vec![top];
    paths.extend(crate::disk::vm_lower_images(&lower).map_err(setup("read the linked layers"))?);
    if paths.len() != chain.layers.len() + 1 {
        return Err(VmError::Io {
            step: "flatten the disk".into(),
            source: io::Error::other("the machine's layers changed while they were linked"),
        });
    }
    crate::disk::check_vm_images(&paths).map_err(setup("check the machine's images"))?;
    let mut spec = serde_json::Value::Null;
    for p in paths.iter().rev() {
        let mut node = json!({"file": {"driver": "file", "filename": p}});
        match Format::of(p) {
            Some(Format::Qcow2) => {
                node["driver"] = json!("qcow2");
                node["backing"] = spec;
            }
            _ => node["driver"] = json!("raw"),
        }
        spec = node;
    }
    let spec = format!("json:{spec}");
    crate::disk::qemu_img(
        &[
            "convert".as_ref(),
            "-U".as_ref(),
            "-O".as_ref(),
            "raw".as_ref(),
            spec.as_ref(),
            out.as_ref(),
        ],
        out,
    )
    .map_err(setup("flatten the disk"))
}

pub(super) fn snapshot_name(top: &Path) -> String {
    let ext = Format::of(top).map_or("img", Format::ext);
    format!("disk.{ext}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_names_only_what_the_host_gives() {
        let ok = Chain {
            top: "disk-2.qcow2".into(),
            node: "disk-2".into(),
            layers: vec![
                "disk-1.qcow2".into(),
                "disk.qcow2".into(),
                "layers/0.qcow2".into(),
                "layers/1.img".into(),
            ],
        };
        assert!(ok.validate().is_ok());
        assert_eq!(ok.next_number(), 3);
        for bad in [
            Chain {
                top: "../x/disk.img".into(),
                ..ok.clone()
            },
            Chain {
                top: "/etc/shadow".into(),
                ..ok.clone()
            },
            Chain {
                layers: vec!["layers/../../x.img".into()],
                ..ok.clone()
            },
            Chain {
                layers: vec!["layers/0.raw".into()],
                ..ok.clone()
            },
            Chain {
                node: "template".into(),
                ..ok.clone()
            },
            Chain {
                layers: vec!["disk-2.qcow2".into()],
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let fresh = Chain {
            top: "disk.img".into(),
            node: "disk".into(),
            layers: vec![],
        };
        assert!(fresh.validate().is_ok());
        assert_eq!(fresh.next_number(), 1);
    }

    #[test]
    fn an_overlay_no_record_names_makes_the_chain_unknown() {
        let dir = std::env::temp_dir().join(format!("locker-chain-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("disk.img"), b"").unwrap();
        assert_eq!(Chain::load(&dir).unwrap().top, "disk.img");
        // A point switched QEMU to disk-1.qcow2, and the server died before the record.
        fs::write(dir.join("disk-1.qcow2"), b"").unwrap();
        assert!(Chain::load(&dir).is_err());
        let moved = Chain {
            top: "disk-1.qcow2".into(),
            node: "disk-1".into(),
            layers: vec!["disk.img".into()],
        };
        moved.store(&dir).unwrap();
        assert_eq!(Chain::load(&dir).unwrap(), moved);
        fs::remove_dir_all(&dir).unwrap();
    }
}
