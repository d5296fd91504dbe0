//! Layer chains: an image's layers stored once by digest and shared between images.
//!
//! Layers are applied one at a time, each into a template of its own: the tree of the
//! image's layers up to and including that one, stored under the digest of
//! [`LAYER_FORMAT`] and the layer's **chain ID** (OCI's: the first layer's is its
//! `diff_id`; layer n's is `sha256(chain(n-1) + " " + diff_id(n))`), so one chain ID is
//! one tree whatever image it came with. A chain's tree is a hard-linked copy of the
//! chain below it ([`link_tree`]: new directories, every other entry a link to the same
//! inode) with the layer unpacked on top; the unpacker never writes through a link (a
//! file it changes is unlinked and created anew, a whiteout unlinks), so the trees below
//! stay as they were. Two images with the same first k layers share k chain templates and
//! store those layers' files once; pulling or importing an image whose first k layers are
//! stored already downloads and unpacks only the rest.
//!
//! The image's own template (its config digest, see `template_digest`) is one more
//! hard-linked copy of its last chain, carrying the image's config, with that chain as its
//! `parent`: chains are step templates, kept while a name needs one of the templates made
//! on them and bounded by the step cache's limits after (`prune`).
//!
//! The unpacked-bytes limit ([`ImageLimits::max_unpacked_bytes`]) bounds what one pull or
//! import writes: a stored chain costs nothing again.

use sha2::{Digest as _, Sha256};
use std::fs;

use super::super::build::ensure_standard_dirs;
use super::super::fsutil::hex;
use super::super::layer::link_tree;
use super::super::store::{Meta, TmpDir};
use super::unpack::{LayerSummary, Unpacker};
use super::*;

/// What a chain template's digest stands for: the tree of the layers of this chain ID,
/// unpacked in order by this room's rules.
pub const LAYER_FORMAT: &str = "locker-template-image-layer-v1";

/// The template digests of an image's layer chains, bottom first: entry `i` is the tree of
/// layers `0..=i` (`diff_ids` are `sha256:<hex>`, checked by [`parse_config`]).
pub(crate) fn chain_digests(diff_ids: &[String]) -> Vec<String> {
    let mut chain = String::new();
    diff_ids
        .iter()
        .map(|d| {
            chain = if chain.is_empty() {
                d.clone()
            } else {
                format!("sha256:{}", hex(&Sha256::digest(format!("{chain} {d}"))))
            };
            let mut h = Sha256::new();
            h.update(LAYER_FORMAT.as_bytes());
            h.update(b"\n");
            h.update(chain.as_bytes());
            hex(&h.finalize())
        })
        .collect()
}

impl TemplateStore {
    /// How many of the image's first layers are stored as chains already (each found one is
    /// marked used for the step cache).
    pub(crate) fn stored_chains(&self, chains: &[String]) -> usize {
        let n = chains.iter().take_while(|c| self.is_built(c)).count();
        for c in &chains[..n] {
            self.touch(c);
        }
        n
    }

    /// Makes chain `chains[i]` unless stored: a hard-linked copy of chain `i - 1` (an empty
    /// tree for the first) with one layer applied by `apply` through `unpacker`, which is
    /// pointed at the new tree first and keeps its running totals. The chain below must be
    /// stored. `None` when another builder had made it meanwhile (nothing was applied).
    pub(crate) fn make_chain(
        &self,
        chains: &[String],
        i: usize,
        unpacker: &mut Unpacker,
        apply: impl FnOnce(&mut Unpacker) -> Result<LayerSummary, TemplateError>,
    ) -> Result<Option<LayerSummary>, TemplateError> {
        let parent = if i == 0 {
            None
        } else {
            Some(self.must_load(&chains[i - 1], "")?)
        };
        let mut summary = None;
        self.make_layer(
            &chains[i],
            parent.as_ref().map_or("", |p| p.digest.as_str()),
            Vec::new(),
            RunConfig::default(),
            |rootfs| {
                match &parent {
                    Some(p) => link_tree(&p.rootfs, rootfs),
                    None => fs::create_dir(rootfs),
                }
                .map_err(io_err("cannot make the layer's tree in", rootfs))?;
                unpacker.retarget(rootfs)?;
                summary = Some(apply(unpacker)?);
                Ok(())
            },
        )?;
        Ok(summary)
    }

    /// Publishes an image as template `digest` over its last chain (which must be stored).
    pub(super) fn commit_image(
        &self,
        tmp: TmpDir,
        digest: &str,
        name: &str,
        image: (&str, RunConfig, String),
        progress: &mut dyn Progress,
    ) -> Result<(), TemplateError> {
        let (top, run, origin) = image;
        let chain = self.must_load(top, "")?;
        let rootfs = tmp.path.join("rootfs");
        link_tree(&chain.rootfs, &rootfs)
            .map_err(io_err("cannot link the image's tree into", &rootfs))?;
        ensure_standard_dirs(&rootfs)?;
        let mut meta = Meta::new(digest, name, None, None, Vec::new());
        meta.config = run;
        meta.image = Some(origin);
        meta.parent = Some(top.to_string());
        self.commit(tmp, meta, progress)
    }
}
