//! Image archives: the tar files `docker save` writes (`manifest.json` at the top, a
//! config and one tar per layer) and OCI image layouts in a tar (`oci-layout`,
//! `index.json`, `blobs/sha256/…`). An archive is indexed once (names to offsets, read
//! with the same bounded header handling as layers), then its members are read in place.
//!
//! What is checked: every blob an OCI layout names by digest (index, manifest, config,
//! layers) against that digest; a docker archive's config against the digest in its file
//! name when it has one; and in both, every layer's uncompressed stream against the
//! config's `rootfs.diff_ids`, which is what pins the root filesystem.

use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::super::fsutil::hex;
use super::super::spec::validate_name;
use super::super::store::TmpDir;
use super::chain::chain_digests;
use super::unpack::{components, Metered, Pending, Unpacker};
use super::*;

/// Symlinks followed from one member to another (old `docker save` links shared layers).
const MAX_HOPS: usize = 8;

/// Where each member of an archive lies.
struct Index {
    path: PathBuf,
    files: HashMap<String, (u64, u64)>,
    links: HashMap<String, String>,
}

fn bad(what: impl std::fmt::Display) -> TemplateError {
    TemplateError::BadImage(format!("the archive {what}"))
}

impl Index {
    fn read(path: &Path) -> Result<Self, TemplateError> {
        let file = File::open(path).map_err(io_err("cannot open", path))?;
        let mut magic = [0u8; 2];
        let _ = (&file).read(&mut magic);
        if magic == [0x1f, 0x8b] {
            return Err(bad(
                "is gzip-compressed: give the plain tar `docker save` or `skopeo copy … oci-archive:` writes (gunzip it first)",
            ));
        }
        let mut file = file;
        file.seek(SeekFrom::Start(0))
            .map_err(io_err("cannot read", path))?;
        let mut archive = tar::Archive::new(file);
        let entries = archive
            .entries_with_seek()
            .map_err(|e| bad(format!("is not a tar file: {e}")))?
            .raw(true);
        let mut index = Index {
            path: path.to_path_buf(),
            files: HashMap::new(),
            links: HashMap::new(),
        };
        let mut pending = Pending::default();
        let label = "the archive";
        for entry in entries {
            let mut entry = entry.map_err(|e| bad(format!("is not a valid tar file: {e}")))?;
            if pending.absorb(&mut entry, label)? {
                continue;
            }
            let ty = entry.header().entry_type();
            let meta_path = pending.take_path(&entry, label)?;
            let Ok(comps) = components(&meta_path.0, label) else {
                continue;
            };
            let name = String::from_utf8_lossy(&comps.join(&b'/')).into_owned();
            if ty.is_file() {
                index
                    .files
                    .insert(name, (entry.raw_file_position(), entry.size()));
            } else if ty.is_symlink() {
                if let Some(target) = meta_path.1 {
                    let dir = name.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
                    let target = String::from_utf8_lossy(&target).into_owned();
                    let joined = if target.starts_with('/') {
                        target
                    } else {
                        format!("{dir}/{target}")
                    };
                    index.links.insert(name, normalize(&joined));
                }
            }
        }
        Ok(index)
    }

    /// The offset and size of member `name`, following links between members.
    fn find(&self, name: &str) -> Option<(u64, u64)> {
        let mut name = normalize(name);
        for _ in 0..MAX_HOPS {
            if let Some(m) = self.files.get(&name) {
                return Some(*m);
            }
            name = self.links.get(&name)?.clone();
        }
        None
    }

    fn open(&self, name: &str) -> Result<(std::io::Take<File>, u64), TemplateError> {
        let (offset, size) = self
            .find(name)
            .ok_or_else(|| bad(format!("has no member {name:?}, which its manifest names")))?;
        let mut file = File::open(&self.path).map_err(io_err("cannot open", &self.path))?;
        file.seek(SeekFrom::Start(offset))
            .map_err(io_err("cannot read", &self.path))?;
        Ok((file.take(size), size))
    }

    /// A small member (JSON), whole.
    fn read_small(&self, name: &str) -> Result<Vec<u8>, TemplateError> {
        let (mut r, size) = self.open(name)?;
        if size > MAX_JSON {
            return Err(bad(format!(
                "member {name:?} is {size} bytes: more than a manifest or config can be"
            )));
        }
        let mut out = Vec::with_capacity(size as usize);
        r.read_to_end(&mut out)
            .map_err(io_err("cannot read", &self.path))?;
        Ok(out)
    }

    /// A blob of an OCI layout, checked against its digest.
    fn read_blob(&self, digest: &str) -> Result<Vec<u8>, TemplateError> {
        if !is_sha256_digest(digest) {
            return Err(bad(format!(
                "names the digest {digest:?}: only sha256 digests are supported"
            )));
        }
        let bytes = self.read_small(&blob_path(digest))?;
        let got = format!("sha256:{}", hex(&Sha256::digest(&bytes)));
        if got != digest {
            return Err(bad(format!(
                "holds a blob {digest} whose content is {got}: the archive is corrupt or was tampered with"
            )));
        }
        Ok(bytes)
    }
}

fn blob_path(digest: &str) -> String {
    format!("blobs/{}", digest.replacen(':', "/", 1))
}

/// `a/./b/../c` → `a/c`, leading `/` dropped (member names only, never host paths).
fn normalize(path: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    out.join("/")
}

/// One layer to apply: where it is and what it must hash to.
struct LayerRef {
    member: String,
    /// The compressed blob's digest (OCI layouts); docker archives have none.
    digest: Option<String>,
}

/// What an archive holds, resolved to one image.
struct Resolved {
    config: Vec<u8>,
    config_digest: String,
    layers: Vec<LayerRef>,
    format: &'static str,
}

fn resolve(index: &Index) -> Result<Resolved, TemplateError> {
    if index.find("oci-layout").is_some() && index.find("index.json").is_some() {
        return resolve_oci(index);
    }
    if index.find("manifest.json").is_some() {
        return resolve_docker(index);
    }
    Err(bad(
        "is not an image archive: it has neither `manifest.json` (docker save) nor `oci-layout` and `index.json` (OCI) at its top",
    ))
}

fn json(bytes: &[u8], what: &str) -> Result<serde_json::Value, TemplateError> {
    serde_json::from_slice(bytes).map_err(|e| bad(format!("has a {what} that is not JSON: {e}")))
}

/// The one manifest of a list to use: linux/amd64 if any says so, else the only one.
fn pick(list: &[serde_json::Value]) -> Result<&serde_json::Value, TemplateError> {
    let amd64 = list.iter().find(|m| {
        m["platform"]["os"].as_str() == Some("linux")
            && m["platform"]["architecture"].as_str() == Some("amd64")
    });
    match (amd64, list) {
        (Some(m), _) => Ok(m),
        (None, [only]) => Ok(only),
        (None, []) => Err(bad("lists no image")),
        (None, _) => Err(bad(
            "lists several images and none for linux/amd64: save one image per archive",
        )),
    }
}

fn resolve_oci(index: &Index) -> Result<Resolved, TemplateError> {
    let mut doc = json(&index.read_small("index.json")?, "index.json")?;
    for _ in 0..4 {
        if let Some(list) = doc["manifests"].as_array() {
            let chosen = pick(list)?;
            let digest = chosen["digest"].as_str().unwrap_or_default().to_string();
            doc = json(&index.read_blob(&digest)?, "manifest")?;
            continue;
        }
        let config_digest = doc["config"]["digest"].as_str().unwrap_or_default();
        let config = index.read_blob(config_digest)?;
        let mut layers = Vec::new();
        for l in doc["layers"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            let digest = l["digest"].as_str().unwrap_or_default();
            if !is_sha256_digest(digest) {
                return Err(bad(format!("names the layer digest {digest:?}")));
            }
            layers.push(LayerRef {
                member: blob_path(digest),
                digest: Some(digest.to_string()),
            });
        }
        return Ok(Resolved {
            config,
            config_digest: config_digest.to_string(),
            layers,
            format: "OCI",
        });
    }
    Err(bad("nests image indexes more than 4 deep"))
}

fn resolve_docker(index: &Index) -> Result<Resolved, TemplateError> {
    let doc = json(&index.read_small("manifest.json")?, "manifest.json")?;
    let first = doc
        .as_array()
        .and_then(|a| a.first())
        .ok_or_else(|| bad("has a manifest.json that lists no image"))?;
    let config_name = first["Config"]
        .as_str()
        .ok_or_else(|| bad("has a manifest.json entry without `Config`"))?;
    let config = index.read_small(config_name)?;
    let config_digest = format!("sha256:{}", hex(&Sha256::digest(&config)));
    // `<hex>.json` (docker) or `blobs/sha256/<hex>` (docker 25+): the name is its digest.
    let named = config_name
        .rsplit('/')
        .next()
        .unwrap_or("")
        .trim_end_matches(".json");
    if named.len() == 64
        && named.bytes().all(locker_sys::hex::is_lower_digit)
        && config_digest != format!("sha256:{named}")
    {
        return Err(bad(format!(
            "has a config {config_name:?} whose content is {config_digest}: the archive is corrupt or was tampered with"
        )));
    }
    let layers = first["Layers"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|l| LayerRef {
            member: l.as_str().unwrap_or_default().to_string(),
            digest: None,
        })
        .collect();
    Ok(Resolved {
        config,
        config_digest,
        layers,
        format: "docker",
    })
}

impl TemplateStore {
    /// Imports a `docker save` or OCI archive (a tar file) as template `name`. Importing
    /// the same image again (or an image pulled before) only adds the name.
    pub fn import_image_archive(
        &self,
        name: &str,
        archive: &Path,
        limits: ImageLimits,
        progress: &mut dyn Progress,
    ) -> Result<Template, TemplateError> {
        let result = self.import_image_unfinished(name, archive, limits, progress);
        progress.finish(result.is_ok());
        result
    }

    fn import_image_unfinished(
        &self,
        name: &str,
        archive: &Path,
        limits: ImageLimits,
        progress: &mut dyn Progress,
    ) -> Result<Template, TemplateError> {
        validate_name(name)?;
        progress.step("reading the image archive", 0.0);
        let index = Index::read(archive)?;
        let image = resolve(&index)?;
        let config = parse_config(&image.config)?;
        if config.diff_ids.len() != image.layers.len() {
            return Err(bad(format!(
                "lists {} layers but its config {}",
                image.layers.len(),
                config.diff_ids.len()
            )));
        }
        let chains = chain_digests(&config.diff_ids);
        let stored = self.stored_chains(&chains);
        let mut sizes = Vec::new();
        for l in &image.layers {
            let (_, size) = index.find(&l.member).ok_or_else(|| {
                bad(format!(
                    "has no member {:?}, which its manifest names",
                    l.member
                ))
            })?;
            sizes.push(size);
        }
        // Layers stored already (as another image's) are neither read nor counted.
        let total: u64 = sizes[stored..].iter().sum();
        if total > limits.max_download_bytes {
            return Err(TemplateError::ImageTooBig(format!(
                "its layers are {total} bytes, more than the limit of {}",
                limits.max_download_bytes
            )));
        }
        progress.output(&format!(
            "{} archive, config {}, {} layers ({stored} stored already), {} to unpack",
            image.format,
            image.config_digest,
            image.layers.len(),
            megabytes(total)
        ));
        let digest = template_digest(&image.config_digest);
        self.clean_stale();
        if !self.is_built(&digest) {
            let _lock = self.lock(&digest, progress)?;
            if !self.is_built(&digest) {
                let tmp = TmpDir::create(&self.templates, &digest)?;
                // Pointed at each layer's own tree before it applies anything.
                let mut unpacker = Unpacker::new(&tmp.path, limits)?;
                let n = image.layers.len();
                let mut done = 0u64;
                for (i, layer) in image.layers.iter().enumerate() {
                    let shown = layer.digest.clone().unwrap_or_else(|| layer.member.clone());
                    let label = format!("layer {}/{n} {shown}", i + 1);
                    if i < stored {
                        progress.output(&format!("{label}: stored already"));
                        continue;
                    }
                    progress.step(&label, 0.05 + 0.9 * done as f64 / total.max(1) as f64);
                    let summary = self.make_chain(&chains, i, &mut unpacker, |u| {
                        let (reader, _) = index.open(&layer.member)?;
                        let mut metered = Metered::new(reader, u64::MAX);
                        let summary = u.apply(&mut metered, &label, Some(&config.diff_ids[i]))?;
                        metered.drain().map_err(io_err("cannot read", archive))?;
                        if let Some(want) = &layer.digest {
                            if metered.digest() != *want {
                                return Err(bad(format!(
                                    "holds a blob {want} whose content is {}: the archive is corrupt or was tampered with",
                                    metered.digest()
                                )));
                            }
                        }
                        Ok(summary)
                    })?;
                    done += sizes[i];
                    match summary {
                        Some(s) => report_layer(progress, &label, sizes[i], &s),
                        None => {
                            progress.output(&format!("{label}: stored by another build meanwhile"))
                        }
                    }
                }
                let origin = archive
                    .canonicalize()
                    .unwrap_or_else(|_| archive.to_path_buf())
                    .display()
                    .to_string();
                let top = chains.last().cloned().unwrap_or_default();
                self.commit_image(tmp, &digest, name, (&top, config.run, origin), progress)?;
            }
        }
        self.set_name(name, &digest)?;
        self.must_load(&digest, name)
    }
}
