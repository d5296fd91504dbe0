//! envd, E2B's in-sandbox daemon, served by the server onto Locker's rooms: the Connect
//! services `process.Process` and `filesystem.Filesystem` (JSON codec), and `/files`,
//! `/health`, `/envs`.

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::{E2bError, Target};
use crate::state::AppState;

pub(crate) async fn serve(_app: AppState, t: Target, req: Request) -> Response {
    if req.uri().path() == "/health" {
        return StatusCode::NO_CONTENT.into_response();
    }
    if !t.authorized {
        return E2bError::unauthorized("missing or wrong X-Access-Token: use the sandbox's envdAccessToken")
            .into_response();
    }
    E2bError::new(
        StatusCode::NOT_IMPLEMENTED,
        format!("{} {}: not served yet", req.method(), req.uri().path()),
    )
    .into_response()
}
