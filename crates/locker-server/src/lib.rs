//! The server: Locker's HTTP API (`docs/api.md`) over the node's machines.
//!
//! Rooms:
//! - [`state`]: configuration and the shared state ([`state::App`], live sandboxes, calls in
//!   flight, ids and clock);
//! - [`app`]: start-up (adoption of machines a killed server left running), the router and
//!   graceful shutdown;
//! - [`auth`]: API keys and tenants on every `/v1` route;
//! - [`sandboxes`], [`exec`], [`files`], [`processes`], [`volumes`], [`runs`], [`snapshots`],
//!   [`templates`], [`admin`], [`ops`]: the routes (handlers: extract, check, call, answer);
//! - [`limits`]: what a sandbox or run may ask for; [`lifecycle`]: a sandbox's life (launch,
//!   lookups, destroy, adoption, idle policy, TTL reaper);
//! - [`ids`]: ids and clocks (a leaf room);
//! - [`command`]: an exec body turned into the agent's spec, and its call record;
//!   [`stream`]: NDJSON answers;
//! - [`pool`]: warm jails for runs; [`vm_pool`]: ready microVMs for sandboxes;
//! - [`error`], [`extract`]: the one error shape and request parsing;
//! - [`failed`]: sandboxes whose agent died or stopped answering;
//! - [`tombstone`]: what the id of a sandbox that is gone answers;
//! - [`metrics`]: Prometheus text;
//! - [`egress`]: egress policies by name: the proxy, the DNS responder, refusals;
//! - [`capacity`]: what the host holds: quota defaults and disk admission;
//! - [`default_template`]: the template `default` built at start when it is missing;
//! - [`mcp`]: `/mcp`, the MCP server (crate `locker-mcp`) over Streamable HTTP;
//! - [`code`]: the code interpreter: contexts on Jupyter kernels in the machine, cells;
//! - [`fleet`]: nodes on other hosts: the fleet CA, join, heartbeats, the lease sweeper
//!   (control side) and `locker node` (member side);
//! - [`ui`]: the dashboard at `/ui` (assets built into the binary, terminal tickets, the
//!   refusal of cross-site state-changing requests).
//!
//! The server owns tenants, records and HTTP; it never touches namespaces or cgroups
//! itself: that is `locker-runtime`'s job.

#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod auth;
pub mod capacity;
pub mod carry;
pub mod code;
pub mod command;
pub mod default_template;
pub mod e2b;
pub mod egress;
pub mod error;
pub mod events;
pub mod exec;
pub mod extract;
pub mod failed;
pub mod files;
pub mod files_tar;
pub mod fleet;
pub mod ids;
pub mod lifecycle;
pub mod limits;
pub mod mcp;
pub mod mcp_bridge;
pub mod metrics;
pub mod ops;
pub mod pool;
pub mod ports;
pub mod processes;
pub mod runs;
pub mod sandboxes;
pub mod secrets;
pub mod snapshots;
pub mod state;
pub mod stream;
pub mod template_image;
pub mod templates;
pub mod tombstone;
pub mod ui;
pub mod usage_series;
pub mod vm_pool;
pub mod volumes;

pub use app::serve;
pub use ports::PreviewDomain;
pub use state::{Config, Quotas};
