//! The session-management tools of the catalogue: find sandboxes again after a context
//! reset, keep one alive, see its background processes, list and delete snapshots.
//!
//! Owns their names, descriptions, schemas and annotations only; `session.rs` carries them
//! out. The shared schema pieces live in `tools.rs`.

use rmcp::model::Tool;
use serde_json::{json, Value};

use crate::tools::{ann, input, process_id, sandbox_id, tool};

/// The most seconds a sandbox may live, as the API allows (`ttl_s` on create and `/ttl`).
pub const MAX_TTL_S: u64 = 2_592_000;

/// One sandbox as sandbox_list shows it: enough to recognise it and act on it.
pub(crate) fn sandbox_brief_schema() -> Value {
    json!({"type": "object",
           "properties": {
               "id": {"type": "string"},
               "state": {"type": "string", "enum": ["starting", "running", "paused", "stopped", "failed"]},
               "template": {"type": "string"},
               "runtime": {"type": "string"},
               "network": {"type": "object", "description": "Its egress policy."},
               "created_at": {"type": "string"},
               "expires_at": {"type": ["string", "null"], "description": "When it will be destroyed (RFC 3339 UTC)."},
               "last_active_at": {"type": ["string", "null"]},
               "metadata": {"type": "object", "additionalProperties": {"type": "string"}}
           },
           "required": ["id", "state"]})
}

fn snapshot_schema() -> Value {
    json!({"type": "object",
           "properties": {
               "id": {"type": "string"}, "sandbox_id": {"type": "string"},
               "template": {"type": "string"}, "runtime": {"type": "string"},
               "size_bytes": {"type": "integer"}, "has_memory": {"type": "boolean"},
               "created_at": {"type": "string"}
           },
           "required": ["id"]})
}

pub(crate) fn all() -> Vec<Tool> {
    vec![
        tool(
            "sandbox_list",
            "List your sandboxes: id, state, template, runtime, network, created_at, expires_at \
and metadata of each. Use it to find a sandbox again when you lost its id (a new conversation, \
a context reset): filter by the metadata labels you gave sandbox_create, e.g. \
metadata={\"task\": \"fix-bug-12\"}, and by state. Also shows what still counts against your \
quotas: delete what you no longer need.",
            input(
                json!({
                    "state": {"type": "string", "enum": ["starting", "running", "paused", "stopped", "failed"],
                              "description": "Only sandboxes in this state."},
                    "metadata": {"type": "object", "additionalProperties": {"type": "string"},
                                 "description": "Only sandboxes whose metadata has all these key/value pairs."}
                }),
                &[],
            ),
            json!({"type": "object",
                   "properties": {"sandboxes": {"type": "array", "items": sandbox_brief_schema()}},
                   "required": ["sandboxes"]}),
            ann("List sandboxes", true, false, true),
        ),
        tool(
            "sandbox_set_ttl",
            "Keep a sandbox alive (or let it go sooner): its expires_at becomes now + ttl_s. A \
sandbox is destroyed with everything in it when expires_at passes, so call this before a long \
task or when you will come back to it later. ttl_s is 1 to 2592000 (30 days); a small value \
ends the sandbox soon. Returns the sandbox with its new expires_at.",
            input(
                json!({
                    "sandbox_id": sandbox_id(),
                    "ttl_s": {"type": "integer", "minimum": 1, "maximum": MAX_TTL_S,
                              "description": "Seconds from now until it is destroyed (at most 2592000 = 30 days)."}
                }),
                &["sandbox_id", "ttl_s"],
            ),
            crate::tools::sandbox_schema(),
            ann("Set a sandbox's time to live", false, false, true),
        ),
        tool(
            "process_list",
            "List the background processes of a sandbox (started by exec with background=true): \
process_id, pid, argv, state (\"running\" or \"exited\"), started_at, and once it exited its \
result (exit_code, reason, without the output: read that with process_output). Use it to find \
a server or watcher you started earlier, or to check what is still running.",
            input(json!({"sandbox_id": sandbox_id()}), &["sandbox_id"]),
            json!({"type": "object",
                   "properties": {"processes": {"type": "array", "items": {"type": "object",
                       "properties": {
                           "process_id": process_id(), "pid": {"type": "integer"},
                           "argv": {"type": "array", "items": {"type": "string"}},
                           "state": {"type": "string", "enum": ["running", "exited"]},
                           "started_at": {"type": "string"},
                           "result": {"type": ["object", "null"], "description": "Once it exited: the ExecResult without stdout and stderr."}
                       },
                       "required": ["process_id", "state"]}}},
                   "required": ["processes"]}),
            ann("List a sandbox's background processes", true, false, true),
        ),
        tool(
            "snapshot_list",
            "List your sandbox snapshots (made by snapshot_create): id, the \
sandbox it was taken of, template, size_bytes, created_at. Snapshots take disk space and \
outlive their sandbox: delete the ones you no longer need with snapshot_delete. sandbox_id \
narrows the list to one sandbox's snapshots.",
            input(
                json!({
                    "sandbox_id": {"type": "string", "pattern": "^sb_[0-9a-f]+$",
                                   "description": "Only the snapshots taken of this sandbox (it may be deleted already)."}
                }),
                &[],
            ),
            json!({"type": "object",
                   "properties": {"snapshots": {"type": "array", "items": snapshot_schema()}},
                   "required": ["snapshots"]}),
            ann("List snapshots", true, false, true),
        ),
        tool(
            "snapshot_delete",
            "Delete a sandbox snapshot (`snap_…`) for good: sandboxes already created from it \
keep running, but no new one can start from it. Deleting one that does not exist (any more) \
is not an error: it answers deleted=false, so a repeated call is safe.",
            input(
                json!({
                    "snapshot_id": {"type": "string", "pattern": "^snap_[0-9a-f]+$",
                                    "description": "The snapshot's id, as snapshot_create or snapshot_list returned it."}
                }),
                &["snapshot_id"],
            ),
            json!({"type": "object",
                   "properties": {"snapshot_id": {"type": "string"},
                                  "deleted": {"type": "boolean", "description": "true: it existed and is gone now; false: there was no such snapshot."}},
                   "required": ["snapshot_id", "deleted"]}),
            ann("Delete a snapshot", false, true, true),
        ),
    ]
}
