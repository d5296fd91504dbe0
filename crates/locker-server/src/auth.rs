//! Who is calling: the tenant and key behind `Authorization: Bearer …`.
//!
//! Owns authentication only. The store keeps keys hashed and answers from an in-memory
//! cache, so this costs one hash and one map lookup per request.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::HeaderMap;

use crate::error::ApiError;
use crate::state::AppState;

/// The caller of a `/v1` route.
#[derive(Debug, Clone)]
pub struct Caller {
    pub tenant: String,
    pub key_id: String,
}

fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    let h = headers
        .get(axum::http::header::AUTHORIZATION)
        .ok_or_else(|| {
            ApiError::unauthorized("missing `Authorization: Bearer <api-key>` header")
        })?;
    let s = h
        .to_str()
        .map_err(|_| ApiError::unauthorized("the Authorization header is not valid text"))?;
    s.strip_prefix("Bearer ")
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| {
            ApiError::unauthorized("the Authorization header must be `Bearer <api-key>`")
        })
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        app: &AppState,
    ) -> Result<Self, Self::Rejection> {
        // On a fleet node, the control plane authenticated the caller (only its
        // certificate opens the node's listener, which sets this).
        if let Some(f) = parts.extensions.get::<crate::fleet::node::Forwarded>() {
            return Ok(Caller {
                tenant: f.tenant.clone(),
                key_id: "fleet".into(),
            });
        }
        caller_of(app, &parts.headers)
    }
}

/// The caller whose key `headers` carry (for routes outside the `/v1` extractors: preview
/// hosts).
pub fn caller_of(app: &AppState, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let key = bearer(headers)?;
    match app.store.authenticate(key) {
        Ok(Some(p)) => Ok(Caller {
            tenant: p.tenant,
            key_id: p.key_id,
        }),
        Ok(None) => Err(ApiError::unauthorized("unknown or revoked API key")),
        Err(e) => Err(ApiError::internal(format!("checking the API key: {e}"))),
    }
}

/// The holder of the admin key (`LOCKER_ADMIN_KEY`).
#[derive(Debug)]
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        app: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let Some(admin) = &app.cfg.admin_key else {
            return Err(ApiError::not_found(
                "admin routes are disabled: start the server with LOCKER_ADMIN_KEY",
            ));
        };
        let key = bearer(&parts.headers)?;
        if constant_time_eq(key.as_bytes(), admin.as_bytes()) {
            Ok(Admin)
        } else {
            Err(ApiError::unauthorized(
                "this route needs the admin key (LOCKER_ADMIN_KEY)",
            ))
        }
    }
}

/// Compares secrets in time that does not depend on where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    #[test]
    fn constant_time_eq_compares() {
        assert!(super::constant_time_eq(b"abc", b"abc"));
        assert!(!super::constant_time_eq(b"abc", b"abd"));
        assert!(!super::constant_time_eq(b"abc", b"ab"));
    }
}
