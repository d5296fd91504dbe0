//! The one error type of the HTTP API and its JSON shape.
//!
//! Every failure a client can see is an [`ApiError`]: a status, a stable code from the API
//! contract, and a message that says what to fix. Handlers return `Result<_, ApiError>`;
//! lower layers' errors are mapped here, in one place.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use locker_proto::{AgentError, ErrorCode};
use locker_runtime::agent::AgentClientError;
use locker_runtime::node::NodeError;

/// An API failure: `{"error": {"code": …, "message": …}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
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
    pub fn conflict(m: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, m)
    }
    pub fn too_large(m: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, m)
    }
    pub fn unprocessable(m: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, m)
    }
    pub fn quota(m: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, m)
    }
    pub fn internal(m: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, m)
    }
    pub fn unavailable(m: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, m)
    }
    /// What a sandbox's port answered (or did not) cannot be relayed.
    pub fn bad_gateway(m: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, m)
    }

    /// The contract's code for a status.
    pub fn code(&self) -> &'static str {
        code_of(self.status)
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({ "error": { "code": self.code(), "message": self.message } })
    }
}

/// The API contract's error code of an HTTP status.
pub fn code_of(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "bad_request",
        401 => "unauthorized",
        403 => "forbidden",
        404 => "not_found",
        405 => "method_not_allowed",
        409 => "conflict",
        410 => "gone",
        413 => "payload_too_large",
        422 => "unprocessable",
        429 => "quota_exceeded",
        501 => "not_implemented",
        502 => "bad_gateway",
        503 => "unavailable",
        _ => "internal",
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code(),
            self.message
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(status = self.status.as_u16(), message = %self.message, "request failed");
        }
        (self.status, axum::Json(self.body())).into_response()
    }
}

impl From<AgentError> for ApiError {
    fn from(e: AgentError) -> Self {
        match e.code {
            ErrorCode::BadRequest => Self::bad_request(e.message),
            ErrorCode::NotFound => Self::not_found(e.message),
            ErrorCode::Conflict => Self::conflict(e.message),
            // A full disk is the machine's quota, not the platform's failure.
            ErrorCode::Exhausted => Self::too_large(e.message),
            // Out of processes or memory inside the machine: its own limits, for now.
            ErrorCode::Busy => Self::quota(e.message),
            ErrorCode::Internal => Self::internal(e.message),
        }
    }
}

impl From<AgentClientError> for ApiError {
    fn from(e: AgentClientError) -> Self {
        match e {
            AgentClientError::Agent(a) => a.into(),
            AgentClientError::TooLarge(m) => Self::too_large(m),
            e @ AgentClientError::Unresponsive(_) => Self::unavailable(format!(
                "{e}; the machine was stopped (a command may have stopped its agent)"
            )),
            other => Self::internal(format!("the machine's agent failed: {other}")),
        }
    }
}

/// A machine operation that failed, as the client sees it: what this host cannot do is a
/// 503 (a runtime that is not usable here, no free machine slot: the host is full, which
/// is no tenant's quota); the rest is the platform's failure, a 500 whose message names the runtime's step.
impl From<NodeError> for ApiError {
    fn from(e: NodeError) -> Self {
        match e {
            NodeError::Unavailable(..)
            | NodeError::Vm(
                locker_runtime::vm::VmError::QemuMissing
                | locker_runtime::vm::VmError::KernelMissing(_),
            ) => Self::unavailable(e.to_string()),
            NodeError::LayersTooDeep(_) | NodeError::OtherQemu(_) => Self::conflict(e.to_string()),
            NodeError::NoSlot => Self::unavailable(format!(
                "{e}: this host is full; try again when machines have ended"
            )),
            other => Self::internal(other.to_string()),
        }
    }
}

impl ApiError {
    /// Maps a machine operation's failure (see `From<NodeError>`) with the step it was in
    /// said first: `starting the sandbox failed: …`.
    pub fn during(step: &'static str) -> impl Fn(NodeError) -> ApiError {
        move |e| {
            let mut a = ApiError::from(e);
            a.message = format!("{step}: {}", a.message);
            a
        }
    }
}

impl From<locker_store::StoreError> for ApiError {
    fn from(e: locker_store::StoreError) -> Self {
        use locker_store::StoreError as S;
        match e {
            S::NotFound(m) => Self::not_found(m),
            S::Conflict(m) => Self::conflict(m),
            S::Invalid(m) => Self::bad_request(m),
            other => Self::internal(format!("state store: {other}")),
        }
    }
}
