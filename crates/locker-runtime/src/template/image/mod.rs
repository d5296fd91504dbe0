//! Templates from OCI images: pulled from a registry over the distribution API, or
//! imported from a `docker save` / OCI archive; layers unpacked in order into a new
//! template's root filesystem, with the image's config kept as the template's
//! [`RunConfig`].
//!
//! This room owns talking to registries (through `oci-client`), verifying digests, and
//! unpacking layers safely (whiteouts, opaque directories, nothing written outside the
//! root being built, no device nodes, a size limit). It does not run anything inside an
//! image and does not know about tenants or the API: the server's template builds call it.
//!
//! A template made from an image is stored under the digest of [`IMAGE_FORMAT`] and the
//! image's config digest (its "image ID"). The config pins every layer by the digest of its
//! uncompressed tar (`rootfs.diff_ids`), which unpacking checks, so one config digest is
//! one root filesystem: pulling the same image again, by tag or digest, or importing it
//! from an archive, only adds a name.
//!
//! Layers are stored once by digest: each layer chain is a template of its own that
//! images sharing those layers share (`chain`), and an image template is a hard-linked
//! copy of its last chain.
//!
//! Rooms: `registry` (pulling with `oci-client`), `archive` (`docker save` and OCI-layout
//! tar files), `chain` (layer chains and publishing the image over its last one), `unpack`
//! (applying layers safely); this file holds what they share: the image config read as a
//! [`RunConfig`] and the limits.

mod archive;
mod chain;
mod registry;
pub(crate) mod unpack;

use sha2::{Digest as _, Sha256};

use super::fsutil::hex;
use super::progress::Progress;
use super::*;

/// What an image template's digest stands for: the image with this config digest, its
/// layers unpacked in order by this room's rules.
pub const IMAGE_FORMAT: &str = "locker-template-image-v1";

/// Largest image config or manifest read (they are small JSON documents).
pub(crate) const MAX_JSON: u64 = 4 << 20;

/// Credentials for a registry (basic auth, or exchanged for a bearer token by the client).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RegistryAuth {
    pub username: String,
    pub password: String,
}

/// Where an image comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSource {
    /// `registry/ns/name:tag` or `…@sha256:<hex>` (Docker Hub's short forms allowed).
    pub reference: String,
    pub auth: Option<RegistryAuth>,
    /// Registries (host or host:port) spoken to over plain HTTP (loopback test registries).
    pub plain_http: Vec<String>,
}

/// Bounds on what one image may cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// Compressed bytes fetched or read, all layers together.
    pub max_download_bytes: u64,
    /// Bytes written into the root filesystem (apparent sizes), all layers together.
    pub max_unpacked_bytes: u64,
}

/// Environment variables that override [`ImageLimits::default`] (bytes).
pub const MAX_DOWNLOAD_ENV: &str = "LOCKER_IMAGE_MAX_DOWNLOAD_BYTES";
/// See [`MAX_DOWNLOAD_ENV`].
pub const MAX_UNPACKED_ENV: &str = "LOCKER_IMAGE_MAX_UNPACKED_BYTES";

impl ImageLimits {
    /// The defaults, each overridden by its environment variable when that holds a number.
    pub fn from_env() -> Self {
        let read = |name: &str, default: u64| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|n| *n > 0)
                .unwrap_or(default)
        };
        let d = Self::default();
        ImageLimits {
            max_download_bytes: read(MAX_DOWNLOAD_ENV, d.max_download_bytes),
            max_unpacked_bytes: read(MAX_UNPACKED_ENV, d.max_unpacked_bytes),
        }
    }
}

impl Default for ImageLimits {
    fn default() -> Self {
        Self {
            max_download_bytes: 8 << 30,
            max_unpacked_bytes: 16 << 30,
        }
    }
}

/// The template digest of the image whose config has digest `config_digest`.
pub(crate) fn template_digest(config_digest: &str) -> String {
    let mut h = Sha256::new();
    h.update(IMAGE_FORMAT.as_bytes());
    h.update(b"\n");
    h.update(config_digest.as_bytes());
    hex(&h.finalize())
}

/// `sha256:<64 lowercase hex>`, the only digest form this room accepts.
pub(crate) fn is_sha256_digest(d: &str) -> bool {
    d.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(locker_sys::hex::is_lower_digit))
}

/// An image config, as far as a template needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ImageConfig {
    pub(crate) run: RunConfig,
    /// `sha256:<hex>` of each layer's uncompressed tar, in order.
    pub(crate) diff_ids: Vec<String>,
}

/// Reads an image config (the OCI and Docker forms are the same where it matters).
pub(crate) fn parse_config(bytes: &[u8]) -> Result<ImageConfig, TemplateError> {
    let bad = |m: String| TemplateError::BadImage(format!("the image config {m}"));
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("is not JSON: {e}")))?;
    if let Some(os) = v["os"].as_str().filter(|o| *o != "linux") {
        return Err(bad(format!("is for {os:?}: only linux images run here")));
    }
    if let Some(arch) = v["architecture"].as_str().filter(|a| *a != "amd64") {
        return Err(bad(format!(
            "is for {arch:?}: this host runs amd64 (pull the linux/amd64 image)"
        )));
    }
    let strings = |x: &serde_json::Value| -> Vec<String> {
        x.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let c = &v["config"];
    let mut run = RunConfig::default();
    for kv in strings(&c["Env"]) {
        if let Some((k, val)) = kv.split_once('=') {
            if !k.is_empty() {
                run.env.insert(k.to_string(), val.to_string());
            }
        }
    }
    let text = |x: &serde_json::Value| x.as_str().filter(|s| !s.is_empty()).map(str::to_string);
    run.workdir = text(&c["WorkingDir"]);
    run.user = text(&c["User"]);
    let mut cmd = strings(&c["Entrypoint"]);
    cmd.extend(strings(&c["Cmd"]));
    run.start_cmd = (!cmd.is_empty()).then_some(cmd);
    if let Some(ports) = c["ExposedPorts"].as_object() {
        for key in ports.keys() {
            let port = key.split('/').next().unwrap_or("");
            if let Ok(p) = port.parse::<u16>() {
                if p > 0 && !run.exposed_ports.contains(&p) {
                    run.exposed_ports.push(p);
                }
            }
        }
        run.exposed_ports.sort_unstable();
    }
    if let Some(labels) = c["Labels"].as_object() {
        for (k, val) in labels {
            if let Some(val) = val.as_str() {
                run.labels.insert(k.clone(), val.to_string());
            }
        }
    }
    let diff_ids = strings(&v["rootfs"]["diff_ids"]);
    if diff_ids.is_empty() {
        return Err(bad("lists no layers (rootfs.diff_ids)".into()));
    }
    if let Some(d) = diff_ids.iter().find(|d| !is_sha256_digest(d)) {
        return Err(bad(format!(
            "names the layer digest {d:?}: only sha256 digests are supported"
        )));
    }
    Ok(ImageConfig { run, diff_ids })
}

/// Reports one unpacked layer: its compressed size, entries and unpacked bytes, and any
/// extended attributes the unpacker dropped.
pub(crate) fn report_layer(
    progress: &mut dyn Progress,
    label: &str,
    size: u64,
    summary: &unpack::LayerSummary,
) {
    progress.output(&format!(
        "{label} {} ({} entries, {} unpacked)",
        megabytes(size),
        summary.entries,
        megabytes(summary.bytes)
    ));
    if summary.dropped_xattrs > 0 {
        progress.output(&format!(
            "{label}: dropped {} extended attributes outside user.* and security.capability",
            summary.dropped_xattrs
        ));
    }
}

/// `12.3 MB`.
pub(crate) fn megabytes(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

#[cfg(test)]
mod tests;
