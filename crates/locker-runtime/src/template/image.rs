//! Templates from OCI images: pulled from a registry over the distribution API, or
//! imported from a `docker save` / OCI archive; layers unpacked in order into a new
//! template's root filesystem, with the image's config kept as the template's
//! [`RunConfig`].
//!
//! This room owns talking to registries (through `oci-client`), verifying digests, and
//! unpacking layers safely (whiteouts, opaque directories, nothing written outside the
//! root being built, no device nodes, a size limit). It does not run anything inside an
//! image and does not know about tenants or the API: the server's template builds call it.

use super::*;

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

impl Default for ImageLimits {
    fn default() -> Self {
        Self {
            max_download_bytes: 8 << 30,
            max_unpacked_bytes: 16 << 30,
        }
    }
}

impl TemplateStore {
    /// Pulls `source` and stores it as template `name`; its digest derives from the
    /// image's manifest digest, so pulling the same image again only adds the name.
    pub async fn pull_image(
        &self,
        name: &str,
        source: &ImageSource,
        limits: ImageLimits,
        progress: &mut (dyn Progress + Send),
    ) -> Result<Template, TemplateError> {
        let _ = (name, source, limits, progress);
        Err(TemplateError::InvalidSpec(
            "pulling images is not in this build yet".into(),
        ))
    }

    /// Imports a `docker save` or OCI archive (a tar file) as template `name`.
    pub fn import_image_archive(
        &self,
        name: &str,
        archive: &Path,
        limits: ImageLimits,
        progress: &mut dyn Progress,
    ) -> Result<Template, TemplateError> {
        let _ = (name, archive, limits, progress);
        Err(TemplateError::InvalidSpec(
            "importing image archives is not in this build yet".into(),
        ))
    }
}
