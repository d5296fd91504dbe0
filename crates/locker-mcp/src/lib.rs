//! Locker's MCP server: the tools an agent needs to use Locker's machines, over the Model
//! Context Protocol, on the official Rust SDK (`rmcp`).
//!
//! Rooms:
//! - [`tools`]: the catalogue (names, descriptions the model reads, schemas, annotations);
//! - [`server`]: [`LockerMcp`], which carries a tool call out as Locker API requests;
//!   `session` carries out the session-management tools (`tools_session`: sandbox_list,
//!   sandbox_set_ttl, process_list, snapshot_list, snapshot_delete), `service` the service
//!   tools (`tools_service`: service_start, port_list); [`text`] holds the
//!   pure text operations (file_edit's `str_replace` and `insert`, an output's tail);
//!   `tools_code` is the code interpreter's `run_code` (catalogue entry and call);
//! - [`api`]: the one way out, Locker's public HTTP API ([`HttpApi`] over the network,
//!   [`TowerApi`] in-process through `locker serve`'s router). Nothing private of the
//!   server is used, so both transports run the same code against the same contract.
//!
//! Transports: [`serve_stdio`] (`locker mcp`, one client on stdin/stdout, the key from
//! `LOCKER_API_KEY`) and [`http_service`] (Streamable HTTP at `/mcp` on `locker serve`;
//! each request's own Bearer key is forwarded). The HTTP service speaks the current
//! revision (2026-07-28, stateless) and the previous session-based ones (2025-11-25 and
//! earlier, `Mcp-Session-Id`), as `rmcp` negotiates them.

#![forbid(unsafe_code)]

pub mod api;
pub mod server;
mod service;
mod session;
mod template;
pub mod text;
pub mod tools;
mod tools_code;
mod tools_service;
mod tools_session;
mod tools_template;

use std::sync::Arc;

pub use api::{Api, ApiError, ApiRequest, ApiResponse, HttpApi, TowerApi};
/// The MCP SDK this crate is built on, for the server's bridge of stdio servers.
pub use rmcp;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::ServiceExt;
pub use server::LockerMcp;

/// Errors of the stdio server.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    #[error("{0}")]
    Config(String),
    #[error("the MCP session failed: {0}")]
    Session(String),
}

/// Serves one MCP client on stdin/stdout until it disconnects, calling the Locker server
/// at `base_url` with `key`.
pub async fn serve_stdio(base_url: &str, key: Option<String>) -> Result<(), McpError> {
    let api = Arc::new(HttpApi::new(base_url).map_err(McpError::Config)?);
    let handler = LockerMcp::new(Arc::new(api), key);
    let running = handler
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| McpError::Session(e.to_string()))?;
    running
        .waiting()
        .await
        .map_err(|e| McpError::Session(e.to_string()))?;
    Ok(())
}

/// The Streamable HTTP service (a tower service; mount it at `/mcp`). The caller checks
/// the Bearer key before a request reaches it; tools forward that key to `api`.
/// `Host` is not checked here: every request needs a key, which a DNS-rebound browser page
/// does not have.
pub fn http_service(api: Arc<dyn Api>) -> StreamableHttpService<LockerMcp, LocalSessionManager> {
    let config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_legacy_session_mode(true);
    StreamableHttpService::new(
        move || Ok(LockerMcp::new(api.clone(), None)),
        Arc::new(LocalSessionManager::default()),
        config,
    )
}
