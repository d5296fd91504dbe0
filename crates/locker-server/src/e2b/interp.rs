//! The code interpreter's protocol (E2B's port 49999: `POST /execute` as NDJSON, `/contexts`)
//! onto Locker's code contexts (`crate::code`).

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::{E2bError, Target};
use crate::state::AppState;

pub(crate) async fn serve(_app: AppState, _t: Target, req: Request) -> Response {
    E2bError::new(
        StatusCode::NOT_IMPLEMENTED,
        format!("{} {}: the code interpreter's protocol is not served yet", req.method(), req.uri().path()),
    )
    .into_response()
}
