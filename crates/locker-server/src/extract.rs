//! Request extractors whose rejections speak the API's error shape.
//!
//! axum's own `Json` and `Query` reject with plain-text bodies; these wrap them so a client
//! always gets `{"error": {...}}` with serde's precise message (which field, what type).

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A JSON body. Unknown fields, wrong types and bodies over the limit are 4xx errors.
pub struct Json<T>(pub T);

impl<S, T> FromRequest<S> for Json<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(Json(v)),
            Err(r) => Err(json_rejection(r)),
        }
    }
}

fn json_rejection(r: JsonRejection) -> ApiError {
    match r {
        JsonRejection::MissingJsonContentType(_) => {
            ApiError::bad_request("send the body as JSON with `Content-Type: application/json`")
        }
        JsonRejection::JsonSyntaxError(e) => ApiError::bad_request(format!(
            "the body is not valid JSON: {}",
            inner(&e.body_text())
        )),
        JsonRejection::JsonDataError(e) => ApiError::bad_request(format!(
            "the body does not match the expected shape: {}",
            inner(&e.body_text())
        )),
        JsonRejection::BytesRejection(e) => {
            let t = e.body_text();
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::too_large(
                    "the JSON body is too large (limit 1 MiB): send files through the files API",
                )
            } else {
                ApiError::bad_request(format!("could not read the body: {t}"))
            }
        }
        other => ApiError::bad_request(other.body_text()),
    }
}

/// serde's message without axum's prefix.
fn inner(t: &str) -> String {
    t.split_once(": ")
        .map(|(_, r)| r.to_owned())
        .unwrap_or_else(|| t.to_owned())
}

/// Query parameters with API-shaped errors.
pub struct Query<T>(pub T);

impl<S, T> FromRequestParts<S> for Query<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(Query(v)),
            Err(QueryRejection::FailedToDeserializeQueryString(e)) => Err(ApiError::bad_request(
                format!("bad query parameters: {}", inner(&e.body_text())),
            )),
            Err(other) => Err(ApiError::bad_request(other.body_text())),
        }
    }
}

/// Checks a path given by a client: absolute, no NUL, not absurdly long.
pub fn check_path(name: &str, p: &str) -> Result<(), ApiError> {
    if p.is_empty() {
        return Err(ApiError::bad_request(format!(
            "`{name}` is required (an absolute path)"
        )));
    }
    if !p.starts_with('/') {
        return Err(ApiError::bad_request(format!(
            "`{name}` must be an absolute path, got {p:?}"
        )));
    }
    if p.contains('\0') {
        return Err(ApiError::bad_request(format!(
            "`{name}` must not contain NUL bytes"
        )));
    }
    if p.len() > 4096 {
        return Err(ApiError::bad_request(format!(
            "`{name}` is longer than 4096 bytes"
        )));
    }
    Ok(())
}

/// The value of `name` in a raw query string, if there is one (internal calls that read
/// one or two arguments by hand).
pub fn query_arg(query: Option<&str>, name: &str) -> Option<String> {
    query.and_then(|q| {
        form_urlencoded::parse(q.as_bytes())
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
    })
}
