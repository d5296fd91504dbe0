//! The service tools of the catalogue: start a server in a sandbox and get the URL that
//! reaches it from outside (service_start), and list what listens (port_list).
//!
//! Owns their names, descriptions, schemas and annotations only; `service.rs` carries them
//! out. The shared schema pieces live in `tools.rs`.

use rmcp::model::Tool;
use serde_json::{json, Value};

use crate::tools::{ann, ann_command, input, process_id, sandbox_id, tool};

/// The longest service_start waits for its port.
pub const MAX_WAIT_S: u64 = 300;

fn port_schema() -> Value {
    json!({"type": "object",
           "properties": {
               "port": {"type": "integer"},
               "address": {"type": "string", "description": "The address it listens on inside the machine (0.0.0.0, 127.0.0.1, ::)."},
               "process": {"type": ["string", "null"], "description": "The program that listens."},
               "pid": {"type": ["integer", "null"]},
               "url": {"type": "string", "description": "The URL that reaches it through Locker (send the API key as a Bearer token)."}
           },
           "required": ["port", "url"]})
}

pub(crate) fn all() -> Vec<Tool> {
    vec![
        tool(
            "service_start",
            "Start a server in a sandbox in the background (a web app, an API, a dev server: \
`python3 -m http.server 8000`, `npm run dev -- --port 3000`) and wait until it listens on `port`; \
returns its process_id and the URL that reaches that port from outside the sandbox through Locker \
(send the same API key as a Bearer token; a paused sandbox wakes up for a request). Inside the \
sandbox, later exec calls reach it at http://localhost:PORT. Bind the server to 0.0.0.0 or \
127.0.0.1; give exactly one of `shell` or `cmd`. It keeps running between calls until it exits, \
process_kill stops it, or the sandbox ends; read its logs with process_output. If it exits or does \
not listen within wait_s seconds, the tool fails and says why (its exit code, or that it still runs \
without listening: read process_output).",
            input(
                json!({
                    "sandbox_id": sandbox_id(),
                    "port": {"type": "integer", "minimum": 1, "maximum": 65535,
                             "description": "The TCP port the server will listen on inside the sandbox."},
                    "shell": {"type": "string", "minLength": 1,
                              "description": "The server's command line for /bin/sh -c, e.g. \"cd /root/app && python3 -m http.server 8000\". Give this or cmd."},
                    "cmd": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                            "description": "The server's argv, run without a shell, e.g. [\"python3\", \"-m\", \"http.server\", \"8000\"]. Give this or shell."},
                    "cwd": {"type": "string", "description": "Working directory, absolute (default /root)."},
                    "env": {"type": "object", "additionalProperties": {"type": "string"},
                            "description": "Extra environment variables for the server, e.g. {\"PORT\": \"3000\"}."},
                    "wait_s": {"type": "integer", "minimum": 1, "maximum": MAX_WAIT_S, "default": 30,
                               "description": "How long to wait for the port to listen, in seconds."}
                }),
                &["sandbox_id", "port"],
            ),
            json!({"type": "object",
                   "properties": {
                       "process_id": process_id(),
                       "pid": {"type": "integer"},
                       "port": {"type": "integer"},
                       "url": {"type": "string", "description": "Reaches the port from outside the sandbox through Locker (API key as a Bearer token)."},
                       "waited_ms": {"type": "integer"}
                   },
                   "required": ["process_id", "port", "url"]}),
            ann_command("Start a server in a sandbox and get its URL"),
        ),
        tool(
            "port_list",
            "List the TCP ports listening inside a sandbox now (servers started by service_start, \
exec with background=true, or a `cmd &` left running by exec), each with the program that \
listens and the URL that reaches it from outside the sandbox through Locker (send the API key as \
a Bearer token). Use it to find the URL of a server you started earlier.",
            input(json!({"sandbox_id": sandbox_id()}), &["sandbox_id"]),
            json!({"type": "object",
                   "properties": {"ports": {"type": "array", "items": port_schema()}},
                   "required": ["ports"]}),
            ann("List a sandbox's listening ports and their URLs", true, false, true),
        ),
    ]
}
