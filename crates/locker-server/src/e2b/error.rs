//! E2B's REST error shape: `{"code": <status>, "message": "…"}` on every non-2xx answer
//! (the SDKs parse the body before they look at the status: a body without `code` breaks
//! them). The envd RPCs answer Connect's own error shape instead (`envd`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// An E2B REST failure.
#[derive(Debug, Clone)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
    pub fn bad_request(m: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, m)
    }
    pub fn unauthorized(m: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, m)
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, m)
    }
}

/// Locker's own failures keep their status and message.
impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> Self {
        Self::new(e.status, e.message)
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        // A 502 is E2B's answer for a sandbox not running, not a failure of this server.
        if self.status.is_server_error() && self.status != StatusCode::BAD_GATEWAY {
            tracing::error!(status = self.status.as_u16(), message = %self.message, "E2B request failed");
        }
        let body = serde_json::json!({"code": self.status.as_u16(), "message": self.message});
        (self.status, axum::Json(body)).into_response()
    }
}
