//! The tool catalogue: names, descriptions, input and output schemas, annotations.
//!
//! The descriptions are the prompt the model reads: each says when to use the tool rather
//! than a sibling, the units, the limits, where truncated output goes, what persists
//! between calls and what does not. Change them with the same care as an API.
//! Owns no behaviour: `server.rs` carries the tools out.

use std::sync::Arc;

use rmcp::model::{JsonObject, Tool, ToolAnnotations};
use serde_json::{json, Value};

/// Server-level instructions sent at initialization (and in `server/discover`).
pub const INSTRUCTIONS: &str = "\
Locker gives you disposable, isolated Linux machines (you are root; the default template is \
Debian with python3, git and curl) to run commands and edit files in, instead of the user's own \
computer.

Two ways to work:
- A sandbox (sandbox_create, then exec / file_* / process_*, then sandbox_delete): a machine \
that lives across calls for up to its ttl_s (default 1800 s). Files and background processes \
persist between calls; each exec starts a fresh shell, so `cd` and `export` do not carry over \
(pass cwd and env instead). A server you run there (service_start) is reached from later calls at http://localhost:PORT and from outside at the URL service_start returns (port_list lists them again). Delete it when done.
- A serverless run (run): one command in a fresh machine on a named volume (a persistent disk); \
the machine is destroyed after the command, the volume's changes are kept. Best for one-shot \
work on a project that must persist without a machine in between.

Network: a machine has none unless you ask (egress none: no DNS, no package downloads); bring \
inputs with file_write, or give sandbox_create or run a `network` policy ({\"egress\": \"all\"}, or \
{\"egress\": \"allow\", \"allow\": [\"pypi.org\", \"files.pythonhosted.org\"]}) to pip install or \
fetch; the server enforces it. After a context reset, sandbox_list finds your sandboxes again \
(metadata helps tell them apart); sandbox_set_ttl keeps one alive longer; snapshot_list and \
snapshot_delete clean up the snapshots you made. A command that exits non-zero, times out or is killed is a normal \
result (see exit_code and reason), not a tool error; tool errors (isError) mean the platform \
could not do what was asked (no such sandbox, bad arguments, a quota). Outputs over \
max_output_bytes are cut in the middle and the full text is kept in a file inside the machine \
whose path is output_path: read it with file_read (line ranges) or exec (grep, tail).";

fn obj(v: Value) -> Arc<JsonObject> {
    match v {
        Value::Object(m) => Arc::new(m),
        _ => unreachable!("schemas are objects"),
    }
}

pub(crate) fn input(props: Value, required: &[&str]) -> Arc<JsonObject> {
    obj(json!({
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": false,
    }))
}

pub(crate) fn ann(
    title: &str,
    read_only: bool,
    destructive: bool,
    idempotent: bool,
) -> ToolAnnotations {
    // Only a command can reach beyond the tenant's own machines and volumes, and only when
    // its machine has a network policy; the other tools never leave them.
    ToolAnnotations::with_title(title)
        .read_only(read_only)
        .destructive(destructive)
        .idempotent(idempotent)
        .open_world(false)
}

/// A tool that runs a command: it reaches the open world when the machine's network policy
/// lets it (`network` on sandbox_create or run).
pub(crate) fn ann_command(title: &str) -> ToolAnnotations {
    ann(title, false, true, false).open_world(true)
}

/// The `network` argument: the API's policy object, checked by the server as for the API.
pub(crate) fn network(what: &str) -> Value {
    json!({"type": "object",
           "description": format!("Network policy of {what} (default {{\"egress\": \"none\"}}: no network, not even DNS). {{\"egress\": \"all\"}} reaches the internet; {{\"egress\": \"allow\", \"allow\": [\"pypi.org\", \"files.pythonhosted.org\", \"*.github.com\", \"10.1.2.0/24\"]}} reaches only those names (a `*.` prefix for subdomains) and IPv4 ranges. The server enforces it below the machine (what is not allowed is refused), never reaches link-local or metadata addresses or the host, and refuses a policy it cannot enforce (unavailable)."),
           "properties": {
               "egress": {"type": "string", "enum": ["none", "all", "allow"]},
               "allow": {"type": "array", "items": {"type": "string", "minLength": 1},
                         "description": "With egress allow: domain names and IPv4 CIDRs."}
           },
           "required": ["egress"],
           "additionalProperties": false})
}

pub(crate) fn tool(
    name: &'static str,
    description: &'static str,
    input: Arc<JsonObject>,
    output: Value,
    annotations: ToolAnnotations,
) -> Tool {
    let title = annotations.title.clone().unwrap_or_default();
    Tool::new(name, description, input)
        .with_title(title)
        .with_raw_output_schema(obj(output))
        .with_annotations(annotations)
}

pub(crate) fn sandbox_id() -> Value {
    json!({"type": "string", "pattern": "^sb_[0-9a-f]+$",
           "description": "The sandbox's id, `sb_…`, as sandbox_create returned it."})
}

pub(crate) fn process_id() -> Value {
    json!({"type": "string", "pattern": "^proc_[0-9A-Za-z]+$",
           "description": "The background process's id, `proc_…`, as exec with background=true returned it."})
}

fn volume_ref(what: &str) -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": 64,
           "description": format!("{what} A volume's name (lowercase letters, digits, `.`, `_`, `-`) or its id `vol_…`.")})
}

fn env() -> Value {
    json!({"type": "object", "additionalProperties": {"type": "string"},
           "description": "Extra environment variables for this command only, e.g. {\"PYTHONUNBUFFERED\": \"1\"}."})
}

fn timeout(default: u64, max: u64) -> Value {
    json!({"type": "integer", "minimum": 1, "maximum": max, "default": default,
           "description": format!("Wall-clock limit in milliseconds (default {default}, at most {max}). When it passes, the whole process tree is killed and the result has reason \"timeout\" with the output produced so far.")})
}

/// process_output's cap: it keeps the end of each stream, not the head and tail.
fn max_output_tail() -> Value {
    json!({"type": "integer", "minimum": 1024, "maximum": 1048576, "default": 65536,
           "description": "Bytes of stdout and of stderr to return (each; default 65536): the LAST this many bytes of each stream, after a `…[locker: first N bytes omitted]…` line when it is longer (then *_truncated is true; *_bytes count the whole stream). Nothing is written to a file: call exec with tail/grep on a redirect, or start the process with its output redirected, to keep everything."})
}

fn max_output() -> Value {
    json!({"type": "integer", "minimum": 1024, "maximum": 1048576, "default": 65536,
           "description": "Bytes of stdout and of stderr to return (each; default 65536). Longer output keeps its head and tail with a `…[locker: N bytes omitted]…` line between, and the full stream is written to output_path."})
}

/// The ExecResult every exec and run returns.
pub(crate) fn exec_result_schema(with_changes: bool) -> Value {
    let mut props = json!({
        "call_id": {"type": "string", "description": "The call's record id (`call_…`)."},
        "exit_code": {"type": ["integer", "null"], "description": "The exit status; null when the command did not exit by itself (signal, timeout, oom)."},
        "signal": {"type": ["string", "null"], "description": "The signal that ended it, e.g. SIGKILL."},
        "reason": {"type": "string", "enum": ["exited", "signaled", "timeout", "oom", "output_limit", "killed"]},
        "stdout": {"type": "string"},
        "stderr": {"type": "string"},
        "stdout_truncated": {"type": "boolean"},
        "stderr_truncated": {"type": "boolean"},
        "stdout_bytes": {"type": "integer", "description": "Bytes produced in all, before truncation."},
        "stderr_bytes": {"type": "integer"},
        "output_path": {"type": ["string", "null"], "description": "When truncated: the file inside the machine (or volume) holding the full output."},
        "stdout_b64": {"type": ["string", "null"], "description": "The kept stdout bytes, base64, only when they are not valid UTF-8 (stdout is then lossy text)."},
        "stderr_b64": {"type": ["string", "null"], "description": "The same for stderr."},
        "timings": {"type": "object", "description": "Milliseconds: queue_ms (arrival to start), start_ms, run_ms, total_ms.",
                    "properties": {"queue_ms": {"type": "number"}, "start_ms": {"type": "number"},
                                   "run_ms": {"type": "number"}, "total_ms": {"type": "number"}}},
        "usage": {"type": "object", "description": "Resources the command used.",
                  "properties": {"cpu_ms": {"type": "integer"}, "peak_memory_bytes": {"type": "integer"}}},
        "changes": {"type": ["object", "null"], "description": "Runs only: added, modified, deleted paths, committed, conflicts."},
    });
    if !with_changes {
        props.as_object_mut().map(|m| m.remove("changes"));
    }
    json!({"type": "object", "properties": props,
           "required": ["exit_code", "reason", "stdout", "stderr", "stdout_truncated", "stderr_truncated"]})
}

/// exec's answer: the ExecResult in the foreground, the process's ids in the background.
fn exec_output_schema() -> Value {
    let mut s = exec_result_schema(false);
    let m = s.as_object_mut().expect("schema");
    m.remove("required");
    m.insert(
        "description".into(),
        "Foreground: the ExecResult (every field below but process_id, pid and sandbox_id). Background: process_id, pid and sandbox_id only.".into(),
    );
    let props = m["properties"].as_object_mut().expect("properties");
    props.insert("process_id".into(), json!({"type": "string", "description": "Background only: the process's id (`proc_…`) for process_output, process_write_stdin, process_kill."}));
    props.insert(
        "pid".into(),
        json!({"type": "integer", "description": "Background only: its pid inside the sandbox."}),
    );
    props.insert(
        "sandbox_id".into(),
        json!({"type": "string", "description": "Background only: the sandbox it runs in."}),
    );
    s
}

/// The `secrets` input of the tools that make machines: names only (a tool never reads a
/// value; the operator creates secrets with `locker secret create`).
fn secrets() -> Value {
    json!({"type": "array", "items": {"type": "string"}, "maxItems": 32,
           "description": "Secrets to attach, by name (created by the operator). Each one's env variable \
holds a placeholder, not the value; the network proxy puts the real value into HTTPS requests to the \
secret's own hosts only, which join the allow list. Sent anywhere else it stays a placeholder."})
}

pub(crate) fn sandbox_schema() -> Value {
    json!({"type": "object",
           "properties": {
               "id": {"type": "string"},
               "state": {"type": "string", "enum": ["starting", "running", "paused", "stopped", "failed"]},
               "template": {"type": "string"},
               "runtime": {"type": "string"},
               "cpus": {"type": "number"},
               "memory_mb": {"type": "integer"},
               "disk_mb": {"type": "integer"},
               "network": {"type": "object"},
               "created_at": {"type": "string"},
               "expires_at": {"type": ["string", "null"], "description": "When it will be destroyed (RFC 3339 UTC)."},
               "metadata": {"type": "object"}
           },
           "required": ["id", "state"]})
}

fn entry_schema() -> Value {
    json!({"type": "object",
           "properties": {
               "path": {"type": "string"}, "name": {"type": "string"},
               "type": {"type": "string", "enum": ["file", "dir", "symlink", "other"]},
               "size": {"type": "integer", "description": "Bytes."},
               "mode": {"type": "integer", "description": "Permission bits as a number (420 = 0644)."},
               "mtime": {"type": "string"}
           },
           "required": ["path", "type"]})
}

fn volume_schema() -> Value {
    json!({"type": "object",
           "properties": {
               "id": {"type": "string"}, "name": {"type": "string"},
               "size_mb": {"type": "integer"}, "used_bytes": {"type": "integer"},
               "created_at": {"type": "string"}
           },
           "required": ["id", "name"]})
}

/// Where a file tool acts: a sandbox, or a volume (no machine needed).
fn file_target(props: &mut Value) {
    let m = props.as_object_mut().expect("props");
    m.insert(
        "sandbox_id".into(),
        json!({"type": "string", "pattern": "^sb_[0-9a-f]+$",
               "description": "The sandbox whose filesystem to use. Give exactly one of sandbox_id and volume."}),
    );
    m.insert(
        "volume".into(),
        json!({"type": "string", "minLength": 1, "maxLength": 64,
               "description": "Instead of a sandbox: a volume (name or `vol_…` id); paths are then relative to the volume's root, which a run sees at /workspace. Give exactly one of sandbox_id and volume."}),
    );
}

fn path(what: &str) -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": 4096,
           "description": format!("{what} An absolute path such as /root/app/main.py.")})
}

/// Every tool, in the order clients list them.
pub fn all() -> Vec<Tool> {
    let mut file_read_props = json!({
        "path": path("The file to read."),
        "start_line": {"type": "integer", "minimum": 1, "default": 1,
                       "description": "First line to return, counting from 1."},
        "end_line": {"type": "integer", "minimum": -1, "default": -1,
                     "description": "Last line to return, inclusive; -1 (the default) means the end of the file."},
        "max_bytes": {"type": "integer", "minimum": 1024, "maximum": 1048576, "default": 65536,
                      "description": "At most this many bytes of content are returned; a longer range is cut at a line boundary, truncated is true and next_start_line says where to continue."},
        "line_numbers": {"type": "boolean", "default": false,
                         "description": "Prefix each line with its number and a tab (`12\\t…`), handy before file_edit insert. The numbers are not part of the file."}
    });
    file_target(&mut file_read_props);
    let mut file_write_props = json!({
        "path": path("The file to create or replace. Missing parent directories are created."),
        "content": {"type": "string", "description": "The whole new content (UTF-8 text)."},
        "mode": {"type": "string", "pattern": "^(0o?)?[0-7]{3,4}$", "default": "0644",
                 "description": "Octal permission bits, e.g. \"0755\" for a script."}
    });
    file_target(&mut file_write_props);
    let mut file_edit_props = json!({
        "path": path("The existing text file to edit."),
        "command": {"type": "string", "enum": ["str_replace", "insert"],
                    "description": "str_replace: replace old_str, which must occur exactly once, by new_str. insert: put new_str after line insert_line."},
        "old_str": {"type": "string", "minLength": 1,
                    "description": "str_replace only: the exact text to replace, byte for byte: same spaces, tabs, line breaks and indentation as in the file. It must occur exactly once; include a few surrounding lines to make it unique."},
        "new_str": {"type": "string",
                    "description": "The replacement (str_replace; empty deletes old_str) or the text to insert (insert; a final line break is added if missing)."},
        "insert_line": {"type": "integer", "minimum": 0,
                        "description": "insert only: insert after this line, counting from 1; 0 inserts at the top of the file. At most the file's line count."}
    });
    file_target(&mut file_edit_props);
    let mut file_list_props = json!({
        "path": path("The directory to list."),
        "depth": {"type": "integer", "minimum": 1, "maximum": 16, "default": 1,
                  "description": "1 lists the directory itself; 2 also the entries of its subdirectories, and so on."}
    });
    file_target(&mut file_list_props);

    vec![
        tool(
            "run",
            "Run one command in a brand-new machine that has a volume (a persistent disk) mounted at \
/workspace, then destroy the machine; the volume keeps the files the command wrote. Use it for \
one-shot work on files that must persist (build a project, run its tests, transform data) when \
you do not need a machine between calls; use sandbox_create + exec instead when you will run \
several commands that share running processes or a long setup.\n\
\n\
Give exactly one of `shell` (a command line run by /bin/sh -c, e.g. \"cd src && make test\") or \
`cmd` (an argv array, no shell). The working directory defaults to /workspace. Nothing but the \
volume survives: not processes, not files outside /workspace, not the environment. With \
create_volume=true a missing volume of that name is created first (size_mb, default 10240).\n\
\n\
Changes: the command sees the volume as it was when the run started, through a private layer; \
when it ends, every path it added, modified or deleted is listed in `changes` and, depending on \
`commit`, applied to the volume at once (all or nothing): \"always\" (default) whatever the exit \
status, \"on_success\" only if it exited 0 and no other run changed the same paths meanwhile, \
\"never\" for a dry run. Two runs in parallel each see the volume as it was when they started.\n\
\n\
Returns the ExecResult: exit_code (null when killed), reason (exited | signaled | timeout | oom \
| output_limit | killed), stdout, stderr, *_truncated, output_path, timings, usage, changes. A \
non-zero exit or a timeout is a normal result, not a tool error. Limits: timeout_ms default \
60000, at most 300000; memory_mb default 512. Network: none (no DNS, no downloads) unless you \
give `network`, e.g. {\"egress\": \"allow\", \"allow\": [\"pypi.org\", \"files.pythonhosted.org\"]} for pip; \
the server enforces it.",
            input(
                json!({
                    "volume": volume_ref("The volume to mount at /workspace."),
                    "create_volume": {"type": "boolean", "default": false,
                                      "description": "Create the volume (by this name) if it does not exist yet."},
                    "size_mb": {"type": "integer", "minimum": 1, "maximum": 1048576, "default": 10240,
                                "description": "Size of a volume created by create_volume, in MiB."},
                    "shell": {"type": "string", "minLength": 1,
                              "description": "A command line for /bin/sh -c. Give this or cmd."},
                    "cmd": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                            "description": "argv, run without a shell, e.g. [\"python3\", \"main.py\"]. Give this or shell."},
                    "cwd": {"type": "string", "description": "Working directory (default /workspace)."},
                    "env": env(),
                    "stdin": {"type": "string", "description": "Text fed to standard input, then closed."},
                    "timeout_ms": timeout(60_000, 300_000),
                    "max_output_bytes": max_output(),
                    "commit": {"type": "string", "enum": ["always", "on_success", "never"], "default": "always",
                               "description": "When the run's file changes are applied to the volume (see the description)."},
                    "template": {"type": "string", "default": "default",
                                 "description": "The machine's root filesystem (template name)."},
                    "memory_mb": {"type": "integer", "minimum": 64, "maximum": 65536, "default": 512,
                                  "description": "Memory limit in MiB; past it the command is killed with reason \"oom\"."},
                    "cpus": {"type": "number", "minimum": 0.1, "maximum": 64, "default": 1},
                    "network": network("the run's machine"),
                    "secrets": secrets()
                }),
                &["volume"],
            ),
            exec_result_schema(true),
            ann_command("Run a command on a volume (serverless)"),
        ),
        tool(
            "sandbox_create",
            "Create a sandbox: an isolated Linux machine (you are root; the default template is Debian \
with python3, pip, git and curl) that stays up across calls until you delete it or its ttl_s passes. Use it when you will \
run several commands, keep background processes (servers, watchers) or build up state step by \
step; for a single command on persistent files prefer `run`.\n\
\n\
Returns the sandbox (id `sb_…`, state, expires_at). Pass its id to exec, file_read, \
file_write, file_edit, file_list, process_* and finally sandbox_delete. What persists inside: \
files (up to disk_mb) and background processes. What does not: each exec is a new shell, so \
`cd` and `export` do not carry over; use exec's cwd and env, or the env given here, which \
every exec inherits. Network: none (no DNS, no package downloads) unless you give `network` \
(all, or an allow list such as pypi.org and files.pythonhosted.org for pip); the server \
enforces it. metadata labels (e.g. {\"task\": \"fix-bug-12\"}) let sandbox_list find it again \
after a context reset. Quotas per tenant limit how \
many sandboxes and how much memory exist at once; past them the call fails with \
quota_exceeded: delete sandboxes you no longer need.",
            input(
                json!({
                    "template": {"type": "string", "default": "default",
                                 "description": "Root filesystem to start from."},
                    "cpus": {"type": "number", "minimum": 0.1, "maximum": 64, "default": 1},
                    "memory_mb": {"type": "integer", "minimum": 64, "maximum": 65536, "default": 512,
                                  "description": "Memory limit in MiB for all its processes together."},
                    "disk_mb": {"type": "integer", "minimum": 64, "maximum": 1048576, "default": 2048,
                                "description": "Disk space in MiB for the files it writes."},
                    "ttl_s": {"type": "integer", "minimum": 1, "maximum": 2592000, "default": 1800,
                              "description": "Seconds until it is destroyed automatically (default 1800 = 30 min, at most 2592000 = 30 days). sandbox_set_ttl changes it later."},
                    "idle_timeout_s": {"type": "integer", "minimum": 1,
                                       "description": "Pause it after this many seconds with no call and no CPU use; the next call resumes it. Default: never."},
                    "env": {"type": "object", "additionalProperties": {"type": "string"},
                            "description": "Environment variables every exec in it inherits."},
                    "network": network("the sandbox"),
                    "secrets": secrets(),
                    "from_snapshot": {"type": "string", "pattern": "^snap_[0-9a-f]+$",
                                      "description": "Start from a snapshot (snapshot_create) instead of the template."},
                    "metadata": {"type": "object", "additionalProperties": {"type": "string"},
                                 "description": "Labels for your own bookkeeping."}
                }),
                &[],
            ),
            sandbox_schema(),
            ann("Create a sandbox", false, false, false),
        ),
        tool(
            "exec",
            "Run a command in a sandbox and, by default, wait for it to finish. Use it for anything \
you would type in a terminal: run tests, inspect the system, install from files you wrote. Use \
file_read / file_write / file_edit rather than cat / echo / sed for files: they are exact and \
cheaper.\n\
\n\
Give exactly one of `shell` (a command line run by /bin/sh -c: pipes, &&, globs, redirections \
work) or `cmd` (an argv array, no shell). Each call is a new process in a fresh shell: `cd` and \
`export` do not carry over to the next call (pass cwd and env); files do. cwd defaults to /root. \
Standard input is empty unless you pass stdin.\n\
\n\
Foreground (default): returns the ExecResult: exit_code (null when killed), reason (exited | \
signaled | timeout | oom | output_limit | killed), stdout, stderr, *_truncated, stdout_bytes, \
output_path, timings (ms), usage. A non-zero exit code is a normal result to read, not a tool \
error. Output longer than max_output_bytes (default 65536 per stream) keeps its head and tail; \
the full output is in the file output_path inside the sandbox. timeout_ms defaults to 60000.\n\
\n\
Background (background=true): for servers, watchers and anything longer than a few minutes. \
Returns at once with process_id; the process keeps running between calls until it exits, you \
process_kill it, or the sandbox is deleted or expires. Read its output with process_output, \
feed it with process_write_stdin. It has no timeout unless you give timeout_ms. No network: \
the sandbox has no egress unless sandbox_create gave it a `network` policy, which the server \
enforces.",
            input(
                json!({
                    "sandbox_id": sandbox_id(),
                    "shell": {"type": "string", "minLength": 1,
                              "description": "A command line for /bin/sh -c, e.g. \"cd /root/app && python3 -m pytest -q\". Give this or cmd."},
                    "cmd": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                            "description": "argv, run without a shell, e.g. [\"ls\", \"-la\", \"/root\"]. Give this or shell."},
                    "cwd": {"type": "string", "description": "Working directory, absolute (default /root)."},
                    "env": env(),
                    "stdin": {"type": "string", "description": "Text fed to standard input (then closed in the foreground; a background process keeps stdin open only if this is absent)."},
                    "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 2_592_000_000u64,
                                   "description": "Wall-clock limit in milliseconds. Foreground: default 60000, at most 3600000. Background: none unless given (at most 2592000000, the longest a sandbox lives); the process ends with its sandbox anyway. When it passes, the whole process tree is killed and the result has reason \"timeout\" with the output produced so far."},
                    "max_output_bytes": max_output(),
                    "background": {"type": "boolean", "default": false,
                                   "description": "Start it and return its process_id at once instead of waiting; it runs until it exits, is killed, or the sandbox ends (no timeout unless timeout_ms is given)."}
                }),
                &["sandbox_id"],
            ),
            exec_output_schema(),
            ann_command("Run a command in a sandbox"),
        ),
        tool(
            "process_output",
            "Read what a background process (exec with background=true) has printed so far, and \
whether it is still running. Use wait_ms to wait for it to finish (up to 60000 ms) instead of \
polling in a loop. Returns state (\"running\" or \"exited\"), stdout and stderr from the start \
(each cut to its last max_output_bytes bytes, with *_truncated and the totals in *_bytes), and \
once it exited, result: its ExecResult (exit_code, reason). A process that exited non-zero is \
a result, not a tool error. Reading does not consume the output: every call returns it from \
the start.",
            input(
                json!({
                    "sandbox_id": sandbox_id(),
                    "process_id": process_id(),
                    "wait_ms": {"type": "integer", "minimum": 0, "maximum": 60000, "default": 0,
                                "description": "Wait up to this many milliseconds for the process to exit before answering (0: answer at once)."},
                    "max_output_bytes": max_output_tail()
                }),
                &["sandbox_id", "process_id"],
            ),
            json!({"type": "object",
                   "properties": {
                       "process_id": {"type": "string"},
                       "state": {"type": "string", "enum": ["running", "exited"]},
                       "stdout": {"type": "string"}, "stderr": {"type": "string"},
                       "stdout_truncated": {"type": "boolean"}, "stderr_truncated": {"type": "boolean"},
                       "stdout_bytes": {"type": "integer"}, "stderr_bytes": {"type": "integer"},
                       "result": {"type": ["object", "null"], "description": "The ExecResult once it exited."}
                   },
                   "required": ["process_id", "state", "stdout", "stderr"]}),
            ann("Read a background process's output", true, false, true),
        ),
        tool(
            "process_write_stdin",
            "Send text to the standard input of a background process started by exec with \
background=true (and without stdin), e.g. a line to a REPL or answers to a prompt. Include the \
line break (\"\\n\") the program waits for. close=true closes its stdin after this write, so it \
sees end of file. Then read the reaction with process_output.",
            input(
                json!({
                    "sandbox_id": sandbox_id(),
                    "process_id": process_id(),
                    "data": {"type": "string", "description": "The text to write, e.g. \"print(1)\\n\"."},
                    "close": {"type": "boolean", "default": false,
                              "description": "Close stdin after writing (the program reads end of file)."}
                }),
                &["sandbox_id", "process_id", "data"],
            ),
            json!({"type": "object", "properties": {"process_id": {"type": "string"}, "written_bytes": {"type": "integer"}, "closed": {"type": "boolean"}},
                   "required": ["process_id", "written_bytes", "closed"]}),
            ann("Write to a process's stdin", false, false, false),
        ),
        tool(
            "process_kill",
            "Send a signal to a background process (exec with background=true): SIGTERM (default) \
asks it to stop, SIGKILL stops it at once, SIGINT is Ctrl-C. Use process_output afterwards to \
see its final output and result. Killing a process that already exited is an error you can \
ignore.",
            input(
                json!({
                    "sandbox_id": sandbox_id(),
                    "process_id": process_id(),
                    "signal": {"type": "string", "enum": ["SIGTERM", "SIGKILL", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGSTOP", "SIGCONT"],
                               "default": "SIGTERM"}
                }),
                &["sandbox_id", "process_id"],
            ),
            json!({"type": "object", "properties": {"process_id": {"type": "string"}, "signal": {"type": "string"}},
                   "required": ["process_id", "signal"]}),
            ann("Signal a background process", false, true, false),
        ),
        tool(
            "sandbox_delete",
            "Destroy a sandbox now: its processes, its files and its disk are gone for good (a \
snapshot taken before survives). Do it when the task is done; sandboxes also go away by \
themselves when their ttl_s passes. Deleting one that does not exist (any more) is not an \
error: it answers deleted=false, so a repeated call is safe.",
            input(json!({"sandbox_id": sandbox_id()}), &["sandbox_id"]),
            json!({"type": "object", "properties": {"sandbox_id": {"type": "string"},
                                                  "deleted": {"type": "boolean", "description": "true: it existed and is gone now; false: there was no such sandbox."}},
                   "required": ["sandbox_id", "deleted"]}),
            ann("Delete a sandbox", false, true, true),
        ),
        tool(
            "file_read",
            "Read a text file from a sandbox (sandbox_id) or a volume (volume), whole or a range of \
lines. Prefer it to `exec cat`: it is exact, reports the total line count, and pages large files. \
Lines count from 1; end_line is inclusive, -1 means the last line. Content beyond max_bytes \
(default 65536) is cut at a line boundary with truncated=true and next_start_line to continue \
from. Use it to read a command's full output from the output_path an exec or run returned. \
Invalid UTF-8 is shown with replacement characters (binary=true then).",
            input(file_read_props, &["path"]),
            json!({"type": "object",
                   "properties": {
                       "path": {"type": "string"},
                       "content": {"type": "string"},
                       "start_line": {"type": "integer"}, "end_line": {"type": "integer"},
                       "total_lines": {"type": "integer"},
                       "size_bytes": {"type": "integer"},
                       "truncated": {"type": "boolean"},
                       "next_start_line": {"type": ["integer", "null"]},
                       "binary": {"type": "boolean"}
                   },
                   "required": ["path", "content", "start_line", "end_line", "total_lines", "truncated"]}),
            ann("Read a file", true, false, true),
        ),
        tool(
            "file_write",
            "Create a file or replace its whole content, in a sandbox (sandbox_id) or a volume \
(volume). Parent directories are created. Use it to bring code, data or configuration into the \
machine (a machine has no network unless it was given a policy). To change part of an \
existing file use file_edit instead: it does \
not need the whole file and cannot clobber unrelated lines. Returns the file's entry (size in \
bytes, mode).",
            input(file_write_props, &["path", "content"]),
            entry_schema(),
            ann("Write a file", false, true, true),
        ),
        tool(
            "file_edit",
            "Edit an existing text file in place, in a sandbox (sandbox_id) or a volume (volume).\n\
- command=str_replace: old_str must occur in the file exactly once, matched byte for byte \
(whitespace, indentation and line breaks included; no regex, no wildcards). If it occurs 0 \
times or more than once, nothing is changed and the error says how many times and on which \
lines: add surrounding lines to old_str to make it unique. new_str replaces it (empty deletes \
it).\n\
- command=insert: new_str is inserted after line insert_line (1-based; 0 = at the top; the \
file's line count = at the end). A line break is added to new_str if it lacks one.\n\
The file keeps its permission bits. Returns the first changed line and a numbered snippet of \
the result around it, to check the edit. Read the file first (file_read, line_numbers=true) \
if you are not sure of its exact text.",
            input(file_edit_props, &["path", "command", "new_str"]),
            json!({"type": "object",
                   "properties": {
                       "path": {"type": "string"},
                       "command": {"type": "string"},
                       "line": {"type": "integer", "description": "First changed line, 1-based."},
                       "snippet": {"type": "string", "description": "Numbered lines around the edit, after it."},
                       "total_lines": {"type": "integer"}
                   },
                   "required": ["path", "command", "line", "snippet"]}),
            ann("Edit a file", false, true, false),
        ),
        tool(
            "file_list",
            "List a directory of a sandbox (sandbox_id) or a volume (volume): name, type (file, dir, \
symlink), size in bytes, mode and mtime of each entry; depth > 1 also lists subdirectories. \
Cheaper and more exact than `exec ls`. A listing of more than 100 000 entries (or 64 MiB) \
fails: list a subdirectory or use a smaller depth (start with depth 1 or 2 on big trees).",
            input(file_list_props, &["path"]),
            json!({"type": "object",
                   "properties": {"entries": {"type": "array", "items": entry_schema()}},
                   "required": ["entries"]}),
            ann("List a directory", true, false, true),
        ),
        tool(
            "snapshot_create",
            "Save a sandbox's filesystem as a snapshot (`snap_…`) without stopping it. Use it before \
a risky step, to come back with sandbox_create(from_snapshot=…), or to start many sandboxes from \
one prepared state. Running processes are not part of it (a sandbox created from it starts with \
no processes). Returns the snapshot: id, size_bytes, created_at.",
            input(json!({"sandbox_id": sandbox_id()}), &["sandbox_id"]),
            json!({"type": "object",
                   "properties": {"id": {"type": "string"}, "sandbox_id": {"type": "string"},
                                  "size_bytes": {"type": "integer"}, "has_memory": {"type": "boolean"},
                                  "created_at": {"type": "string"}},
                   "required": ["id"]}),
            ann("Snapshot a sandbox", false, false, false),
        ),
        tool(
            "sandbox_fork",
            "Make `count` new sandboxes, each a copy of this sandbox's files as of now, to try \
alternatives in parallel (different fixes, different parameters) without them affecting each \
other. The original keeps running unchanged. Processes are not copied. Each copy counts against \
your quotas and must be deleted (sandbox_delete) when done. Returns {sandboxes: [...]}.",
            input(
                json!({
                    "sandbox_id": sandbox_id(),
                    "count": {"type": "integer", "minimum": 1, "maximum": 10, "default": 1,
                              "description": "How many copies (1 to 10)."}
                }),
                &["sandbox_id"],
            ),
            json!({"type": "object",
                   "properties": {"sandboxes": {"type": "array", "items": sandbox_schema()}},
                   "required": ["sandboxes"]}),
            ann("Fork a sandbox", false, false, false),
        ),
        tool(
            "volume_create",
            "Create a volume: a named persistent disk that outlives machines. Use it to keep a \
project between `run` calls (or create it on the fly with run's create_volume=true). Names are \
unique per tenant: lowercase letters, digits, `.`, `_`, `-`, at most 63 characters, not \
starting with `vol_`; an existing name answers conflict. size_mb is the space its files may \
use (default 10240 MiB). Put files in with file_write(volume=…).",
            input(
                json!({
                    "name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9._-]{0,62}$",
                             "description": "The volume's name, e.g. \"my-project\"."},
                    "size_mb": {"type": "integer", "minimum": 1, "maximum": 1048576, "default": 10240,
                                "description": "Capacity in MiB."}
                }),
                &["name"],
            ),
            volume_schema(),
            ann("Create a volume", false, false, false),
        ),
        tool(
            "volume_list",
            "List your volumes (the persistent disks `run` mounts): id, name, size_mb and used_bytes \
of each. Use it to find a project's volume by name before calling run or file_read on it.",
            input(json!({}), &[]),
            json!({"type": "object",
                   "properties": {"volumes": {"type": "array", "items": volume_schema()}},
                   "required": ["volumes"]}),
            ann("List volumes", true, false, true),
        ),
    ]
    .into_iter()
    .chain(crate::tools_session::all())
    .chain(crate::tools_service::all())
    .chain(crate::tools_code::all())
    .chain(crate::tools_template::all())
    .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_tool_is_strict_and_documented() {
        let tools = super::all();
        assert_eq!(tools.len(), 25);
        for t in &tools {
            assert_eq!(
                t.input_schema.get("additionalProperties"),
                Some(&serde_json::Value::Bool(false)),
                "{}",
                t.name
            );
            assert!(t.output_schema.is_some(), "{}", t.name);
            let a = t.annotations.as_ref().expect("annotations");
            assert!(a.read_only_hint.is_some() && a.destructive_hint.is_some());
            assert!(a.idempotent_hint.is_some() && a.open_world_hint.is_some());
            assert!(
                t.description.as_ref().is_some_and(|d| d.len() > 150),
                "{}",
                t.name
            );
        }
    }
}
