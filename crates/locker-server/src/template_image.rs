//! `PUT /v1/templates/{name}/image`: a `docker save` or OCI archive in the body becomes a
//! template.
//!
//! The body is streamed to a file under the data dir's `uploads/` (bounded by the image
//! download limit, removed when the request ends), then handed to the template room's
//! [`TemplateStore::import_image_archive`](locker_runtime::template::TemplateStore), which
//! checks and unpacks it. Templates live in the host's shared cache, so only tenant
//! `default` may import, and the names Locker builds itself are refused.
//!
//! [`image_error`] is how every image failure reads over the API (400 for a bad or hostile
//! image, 413 over the limits, 502 when a registry is at fault); builds that pull images
//! use it too. This room never runs anything inside an image.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::put;
use axum::Router;
use futures_util::TryStreamExt as _;
use locker_runtime::template::{
    ImageLimits, NoProgress, Template, TemplateError, CODE_INTERPRETER_TEMPLATE, DEFAULT_TEMPLATE,
};
use serde_json::json;
use tokio::io::AsyncWriteExt as _;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::events::Kind;
use crate::state::AppState;

pub fn routes() -> Router<AppState> {
    Router::new().route(
        "/v1/templates/{name}/image",
        put(import).layer(axum::extract::DefaultBodyLimit::disable()),
    )
}

/// An image failure as the API answers it.
pub fn image_error(e: TemplateError) -> ApiError {
    match e {
        TemplateError::InvalidName { .. } | TemplateError::BadImage(_) => {
            ApiError::bad_request(e.to_string())
        }
        TemplateError::ImageTooBig(_) => ApiError::too_large(e.to_string()),
        TemplateError::Registry(_) => ApiError::bad_gateway(e.to_string()),
        e => ApiError::internal(format!("importing the image: {e}")),
    }
}

/// A template as the API shows it (never its host path).
pub fn template_json(t: &Template) -> serde_json::Value {
    json!({
        "name": t.name,
        "digest": t.digest,
        "size_bytes": t.size_bytes,
        "created_at": t.created_at,
        "packages": t.packages,
        "config": t.config,
    })
}

/// Most of a refused body read (and dropped) so that the client gets to read the 413
/// rather than a reset connection; past it the connection is closed.
const DRAIN_BYTES: u64 = 256 << 20;

async fn drain(stream: &mut axum::body::BodyDataStream) {
    let mut n = 0u64;
    while let Ok(Some(chunk)) = stream.try_next().await {
        n += chunk.len() as u64;
        if n > DRAIN_BYTES {
            break;
        }
    }
}

/// Removes the uploaded archive however the request ends.
struct Upload(std::path::PathBuf);

impl Drop for Upload {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn import(
    State(app): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<impl IntoResponse, ApiError> {
    if caller.tenant != locker_store::DEFAULT_TENANT {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "templates are shared by every tenant of this host: only tenant `default` (the host's owner) may import one",
        ));
    }
    locker_runtime::template::validate_name(&name).map_err(image_error)?;
    if name == DEFAULT_TEMPLATE || name == CODE_INTERPRETER_TEMPLATE {
        return Err(ApiError::conflict(format!(
            "{name:?} is built by Locker itself (`locker template build {name}`): import the image under another name"
        )));
    }
    let limits = ImageLimits::from_env();
    let too_big = || {
        ApiError::too_large(format!(
            "the archive is over the image limit of {} bytes: raise LOCKER_IMAGE_MAX_DOWNLOAD_BYTES on the server or send a smaller image",
            limits.max_download_bytes
        ))
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut stream = body.into_data_stream();
    if declared.is_some_and(|n| n > limits.max_download_bytes) {
        drain(&mut stream).await;
        return Err(too_big());
    }
    let dir = app.cfg.data_dir.join("uploads");
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
    let upload = Upload(dir.join(format!("{}.tar", crate::ids::new_id("img_"))));
    let mut file = tokio::fs::File::create(&upload.0)
        .await
        .map_err(|e| ApiError::internal(format!("creating {}: {e}", upload.0.display())))?;
    let mut received = 0u64;
    while let Some(chunk) = stream
        .try_next()
        .await
        .map_err(|e| ApiError::bad_request(format!("reading the archive: {e}")))?
    {
        received += chunk.len() as u64;
        if received > limits.max_download_bytes {
            drain(&mut stream).await;
            return Err(too_big());
        }
        file.write_all(&chunk)
            .await
            .map_err(|e| ApiError::internal(format!("saving the archive: {e}")))?;
    }
    file.flush()
        .await
        .map_err(|e| ApiError::internal(format!("saving the archive: {e}")))?;
    drop(file);
    if received == 0 {
        return Err(ApiError::bad_request(
            "the body is empty: send the archive (`docker save` or an OCI archive) as the body",
        ));
    }
    let store = app.templates.clone();
    let (n, path) = (name.clone(), upload.0.clone());
    // Its own task: a client that hangs up does not cut an import in half.
    let result = tokio::task::spawn_blocking(move || {
        store.import_image_archive(&n, &path, limits, &mut NoProgress)
    })
    .await
    .map_err(|e| ApiError::internal(format!("importing the image: {e}")))?;
    drop(upload);
    match result {
        Ok(t) => {
            let body = template_json(&t);
            app.events
                .emit(&caller.tenant, Kind::TemplateBuilt, &name, body.clone());
            Ok((StatusCode::CREATED, axum::Json(body)))
        }
        Err(e) => {
            let err = image_error(e);
            app.events.emit(
                &caller.tenant,
                Kind::TemplateFailed,
                &name,
                json!({ "reason": err.message }),
            );
            Err(err)
        }
    }
}
