//! Pulling from a registry over the OCI distribution API, with `oci-client`: reference
//! parsing (Docker Hub's short forms included), the token and basic auth dance, manifest
//! lists resolved to linux/amd64, and every manifest and blob checked against its digest.
//!
//! This room adds what the client leaves open: bounds (the config's size, the layers'
//! declared and actual bytes, a deadline per request so a registry that stalls or
//! trickles cannot hold a build forever) and the pipeline: layer `n+1` downloads while
//! layer `n` unpacks on a blocking thread. Layers are written to the build's own
//! directory, verified by the client, unpacked, then deleted. Layers stored already as
//! another image's chain (`chain`) are not fetched at all.
//!
//! One bound is missing: the client reads a manifest's body whole (`bytes()`), with no
//! hook for a size cap, and fetching manifests by hand would mean writing the protocol's
//! HTTP ourselves. Only [`MANIFEST_DEADLINE`] and [`READ_TIMEOUT`] bound it, so a hostile
//! registry can make one pull hold what it sends in 60 s in memory; docs/operations.md
//! says so.

use oci_client::client::{linux_amd64_resolver, ClientConfig, ClientProtocol};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth as ClientAuth;
use oci_client::{Client, Reference};
use std::fs;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::AsyncWrite;

use super::super::progress::NoProgress;
use super::super::spec::validate_name;
use super::super::store::TmpDir;
use super::chain::chain_digests;
use super::unpack::{LayerSummary, Unpacker};
use super::*;

/// How long connecting to a registry may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a registry may stay silent in the middle of an answer.
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long resolving a reference to a manifest and fetching the config may take.
const MANIFEST_DEADLINE: Duration = Duration::from_secs(60);
/// The slowest transfer rate a blob download is given time for (bytes per second), on
/// top of [`MANIFEST_DEADLINE`].
const MIN_RATE: u64 = 1 << 20;

const LAYER_TYPES: &[&str] = &[
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
];
const CONFIG_TYPES: &[&str] = &[
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.docker.container.image.v1+json",
];

fn registry_error(what: &str, e: impl std::fmt::Display) -> TemplateError {
    TemplateError::Registry(format!("{what}: {e}"))
}

/// An `AsyncWrite` that refuses to take more than `limit` bytes in all.
struct Capped<W> {
    inner: W,
    written: u64,
    limit: u64,
    refused: bool,
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Capped<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.written + buf.len() as u64 > self.limit {
            self.refused = true;
            return Poll::Ready(Err(std::io::Error::other(format!(
                "the registry sent more than the {} bytes allowed",
                self.limit
            ))));
        }
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &poll {
            self.written += *n as u64;
        }
        poll
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A blob's declared size, refused when negative.
fn declared(d: &OciDescriptor) -> Result<u64, TemplateError> {
    u64::try_from(d.size).map_err(|_| {
        TemplateError::BadImage(format!("the manifest gives {} a negative size", d.digest))
    })
}

fn blob_deadline(size: u64) -> Duration {
    MANIFEST_DEADLINE + Duration::from_secs(size / MIN_RATE)
}

/// A blocking unpack of one layer, running while the next downloads.
type Unpacking = tokio::task::JoinHandle<(Unpacker, Result<Option<LayerSummary>, TemplateError>)>;

impl TemplateStore {
    /// Pulls `source` and stores it as template `name`. Its digest derives from the image's
    /// config digest, so pulling the same image again (by tag or digest) only adds the name.
    pub async fn pull_image(
        &self,
        name: &str,
        source: &ImageSource,
        limits: ImageLimits,
        progress: &mut (dyn Progress + Send),
    ) -> Result<Template, TemplateError> {
        let result = self.pull_unfinished(name, source, limits, progress).await;
        progress.finish(result.is_ok());
        result
    }

    async fn pull_unfinished(
        &self,
        name: &str,
        source: &ImageSource,
        limits: ImageLimits,
        progress: &mut (dyn Progress + Send),
    ) -> Result<Template, TemplateError> {
        validate_name(name)?;
        let reference: Reference = source.reference.parse().map_err(|e| {
            TemplateError::BadImage(format!(
                "{:?} is not an image reference ({e}): write registry/name:tag or registry/name@sha256:…",
                source.reference
            ))
        })?;
        let client = Client::new(ClientConfig {
            protocol: ClientProtocol::HttpsExcept(source.plain_http.clone()),
            platform_resolver: Some(Box::new(linux_amd64_resolver)),
            connect_timeout: Some(CONNECT_TIMEOUT),
            read_timeout: Some(READ_TIMEOUT),
            ..Default::default()
        });
        let auth = match &source.auth {
            Some(a) => ClientAuth::Basic(a.username.clone(), a.password.clone()),
            None => ClientAuth::Anonymous,
        };
        progress.step(&format!("resolving {reference}"), 0.0);
        let (manifest, manifest_digest) = tokio::time::timeout(
            MANIFEST_DEADLINE,
            client.pull_image_manifest(&reference, &auth),
        )
        .await
        .map_err(|_| {
            registry_error(
                "fetching the manifest",
                "the registry did not answer in time",
            )
        })?
        .map_err(|e| {
            let hint = if source.plain_http.is_empty() && e.to_string().contains("https://") {
                " (a registry without TLS must be named as a plain-HTTP one: --plain-http HOST)"
            } else {
                ""
            };
            registry_error(
                &format!("fetching the manifest of {reference}"),
                format!("{e}{hint}"),
            )
        })?;
        if !CONFIG_TYPES.contains(&manifest.config.media_type.as_str()) {
            return Err(TemplateError::BadImage(format!(
                "{reference} is not a container image (its config is {:?})",
                manifest.config.media_type
            )));
        }
        let config_size = declared(&manifest.config)?;
        if config_size > MAX_JSON {
            return Err(TemplateError::BadImage(format!(
                "the image config is {config_size} bytes: more than a config can be"
            )));
        }
        let mut config_bytes = Capped {
            inner: Vec::new(),
            written: 0,
            limit: MAX_JSON,
            refused: false,
        };
        tokio::time::timeout(
            MANIFEST_DEADLINE,
            client.pull_blob(&reference, &manifest.config, &mut config_bytes),
        )
        .await
        .map_err(|_| {
            registry_error(
                "fetching the image config",
                "the registry did not answer in time",
            )
        })?
        .map_err(|e| registry_error("fetching the image config", e))?;
        let config = parse_config(&config_bytes.inner)?;
        if config.diff_ids.len() != manifest.layers.len() {
            return Err(TemplateError::BadImage(format!(
                "the manifest lists {} layers but the config {}",
                manifest.layers.len(),
                config.diff_ids.len()
            )));
        }
        for l in &manifest.layers {
            if !LAYER_TYPES.contains(&l.media_type.as_str()) {
                return Err(TemplateError::BadImage(format!(
                    "the layer {} has the media type {:?}, which is not a container layer this build unpacks (plain, gzip or zstd tar)",
                    l.digest, l.media_type
                )));
            }
            declared(l)?;
        }
        let chains = chain_digests(&config.diff_ids);
        // Layers stored already (as another image's) are neither fetched nor counted.
        let stored = self.stored_chains(&chains);
        let total = manifest.layers[stored..]
            .iter()
            .map(|l| declared(l).unwrap_or(0))
            .fold(0u64, u64::saturating_add);
        if total > limits.max_download_bytes {
            return Err(TemplateError::ImageTooBig(format!(
                "its layers are {total} bytes, more than the limit of {}",
                limits.max_download_bytes
            )));
        }
        progress.output(&format!(
            "{reference}@{manifest_digest}: config {}, {} layers ({stored} stored already), {} to fetch",
            manifest.config.digest,
            manifest.layers.len(),
            megabytes(total)
        ));
        let digest = template_digest(&manifest.config.digest);
        let origin = format!("{reference}@{manifest_digest}");
        let store = self.clone();
        let d = digest.clone();
        if !self.is_built(&digest) {
            progress.step("waiting for the template lock", 0.02);
            let lock = tokio::task::spawn_blocking(move || {
                store.clean_stale();
                store.lock(&d, &mut NoProgress)
            })
            .await
            .map_err(|e| registry_error("locking the template", e))??;
            if !self.is_built(&digest) {
                let tmp = TmpDir::create(&self.templates, &digest)?;
                let fetched = self
                    .fetch_and_unpack(
                        &client,
                        &reference,
                        &manifest.layers,
                        &config,
                        (&chains, stored),
                        &tmp,
                        limits,
                        total,
                        progress,
                    )
                    .await;
                if let Err(e) = fetched {
                    drop(tmp);
                    drop(lock);
                    return Err(e);
                }
                let store = self.clone();
                let (d, n) = (digest.clone(), name.to_string());
                let top = chains.last().cloned().unwrap_or_default();
                progress.step("measuring and saving", 0.97);
                tokio::task::spawn_blocking(move || {
                    store.commit_image(tmp, &d, &n, (&top, config.run, origin), &mut NoProgress)
                })
                .await
                .map_err(|e| registry_error("saving the template", e))??;
            }
            drop(lock);
        }
        self.set_name(name, &digest)?;
        progress.step("done", 1.0);
        self.must_load(&digest, name)
    }

    /// Downloads each layer past the `first` stored already into `tmp/layers/` and unpacks
    /// it as its chain template (see `chain`), the next download overlapping the previous unpack. Waits for
    /// a running unpack before returning, so that nothing writes once this returns.
    #[allow(clippy::too_many_arguments)]
    async fn fetch_and_unpack(
        &self,
        client: &Client,
        reference: &Reference,
        layers: &[OciDescriptor],
        config: &ImageConfig,
        (chains, first): (&[String], usize),
        tmp: &TmpDir,
        limits: ImageLimits,
        total: u64,
        progress: &mut (dyn Progress + Send),
    ) -> Result<(), TemplateError> {
        let dir = tmp.path.join("layers");
        fs::create_dir(&dir).map_err(io_err("cannot create", &dir))?;
        let n = layers.len();
        for (i, layer) in layers.iter().enumerate().take(first) {
            progress.output(&format!(
                "layer {}/{n} {}: stored already",
                i + 1,
                layer.digest
            ));
        }
        // Pointed at each layer's own tree before it applies anything.
        let mut unpacker = Some(Unpacker::new(&dir, limits)?);
        let mut running: Option<(Unpacking, String, u64)> = None;
        let mut downloaded = 0u64;
        let mut failure = None;
        for (i, layer) in layers.iter().enumerate().skip(first) {
            let label = format!("layer {}/{n} {}", i + 1, layer.digest);
            progress.step(
                &format!("downloading {label}"),
                0.05 + 0.9 * downloaded as f64 / total.max(1) as f64,
            );
            let path = dir.join(i.to_string());
            let got = self
                .download(
                    client,
                    reference,
                    layer,
                    &path,
                    limits.max_download_bytes - downloaded,
                )
                .await;
            if let Some((h, l, size)) = running.take() {
                match finish(h, &l, size, progress).await {
                    Ok(u) => unpacker = Some(u),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            let size = match got {
                Ok(size) => size,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            downloaded += size;
            let mut u = unpacker
                .take()
                .expect("the unpacker is back after each layer");
            let diff_id = config.diff_ids[i].clone();
            let (store, chains, l) = (self.clone(), chains.to_vec(), label.clone());
            let handle = tokio::task::spawn_blocking(move || {
                let r = store.make_chain(&chains, i, &mut u, |u| {
                    let f = fs::File::open(&path).map_err(io_err("cannot open", &path))?;
                    u.apply(std::io::BufReader::new(f), &l, Some(&diff_id))
                });
                let _ = fs::remove_file(&path);
                (u, r)
            });
            running = Some((handle, label, size));
        }
        if let Some((h, l, size)) = running.take() {
            let r = finish(h, &l, size, progress).await;
            if failure.is_none() {
                r?;
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        fs::remove_dir(&dir).map_err(io_err("cannot remove", &dir))?;
        Ok(())
    }

    /// One blob into `path`, checked against its digest by the client; its size.
    async fn download(
        &self,
        client: &Client,
        reference: &Reference,
        layer: &OciDescriptor,
        path: &PathBuf,
        budget: u64,
    ) -> Result<u64, TemplateError> {
        let file = tokio::fs::File::create(path)
            .await
            .map_err(io_err("cannot create", path))?;
        let mut out = Capped {
            inner: file,
            written: 0,
            limit: budget,
            refused: false,
        };
        let size = declared(layer)?;
        let pulled = tokio::time::timeout(
            blob_deadline(size),
            client.pull_blob(reference, layer, &mut out),
        )
        .await;
        match pulled {
            Err(_) => {
                return Err(registry_error(
                    &format!("downloading {}", layer.digest),
                    "the registry is too slow (less than 1 MB/s) or stalled",
                ))
            }
            Ok(Err(_)) if out.refused => {
                return Err(TemplateError::ImageTooBig(format!(
                    "the registry sent more for {} than the download limit of the image allows",
                    layer.digest
                )))
            }
            Ok(Err(e)) => return Err(registry_error(&format!("downloading {}", layer.digest), e)),
            Ok(Ok(())) => {}
        }
        use tokio::io::AsyncWriteExt as _;
        out.inner
            .flush()
            .await
            .map_err(io_err("cannot write", path))?;
        Ok(out.written)
    }
}

/// Waits for an unpack; reports it.
async fn finish(
    handle: Unpacking,
    label: &str,
    size: u64,
    progress: &mut (dyn Progress + Send),
) -> Result<Unpacker, TemplateError> {
    let (u, r) = handle
        .await
        .map_err(|e| registry_error("unpacking a layer", e))?;
    match r? {
        Some(summary) => report_layer(progress, label, size, &summary),
        None => progress.output(&format!("{label}: stored by another build meanwhile")),
    }
    Ok(u)
}
