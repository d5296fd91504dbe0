//! The template tools of the catalogue: build a template of your own (from `default` or
//! another template with run steps and packages, or from a Dockerfile) and list templates.
//!
//! Owns their names, descriptions, schemas and annotations only; `template.rs` carries
//! them out. The shared schema pieces live in `tools.rs`.

use rmcp::model::Tool;
use serde_json::{json, Value};

use crate::tools::{ann, input, network, tool};

fn template_schema() -> Value {
    json!({"type": "object",
           "properties": {
               "name": {"type": "string"},
               "digest": {"type": "string"},
               "size_bytes": {"type": "integer"},
               "created_at": {"type": "string"},
               "env": {"type": "object", "additionalProperties": {"type": "string"}},
               "workdir": {"type": ["string", "null"]},
               "user": {"type": ["string", "null"]},
               "start_cmd": {"type": ["array", "null"], "items": {"type": "string"}}
           },
           "required": ["name", "digest"]})
}

pub(crate) fn all() -> Vec<Tool> {
    vec![
        tool(
            "template_build",
            "Build a template of your own: a root filesystem that sandboxes and runs can start \
from (sandbox_create's and run's `template`), so a setup you need often (packages, a toolchain, \
a cloned repository) is done once instead of in every sandbox. Give `from_template` (default \
`default`) with `run` steps (shell commands run as root, in order) and `packages` (Debian \
packages; they need a `network` that reaches deb.debian.org), or a whole `dockerfile` (FROM \
default or another of your templates; RUN, ENV, ARG, WORKDIR, USER, CMD, EXPOSE, LABEL; COPY \
needs an uploaded context, which this tool cannot send: write files with RUN instead). `env`, \
`workdir`, `user` and `start_cmd` are what sandboxes made from it get. Steps are cached: a \
rebuild with one changed step reruns from that step only. Waits for the build (at most \
`timeout_s`, default 1200) and returns the template, or an error with the build's last log \
lines. The build's machine has no network unless `network` says so.",
            input(
                json!({
                    "name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9._-]{0,48}$",
                             "description": "The template's name (lowercase letters, digits, '.', '_', '-'). Building a name again replaces it."},
                    "from_template": {"type": "string", "description": "The template to start from (default `default`). Not with `dockerfile`."},
                    "run": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 64,
                            "description": "Shell commands run as root in `/`, in order, each in the result of the one before."},
                    "packages": {"type": "array", "items": {"type": "string"}, "maxItems": 256,
                                 "description": "Debian packages to apt-get install first (needs `network`)."},
                    "dockerfile": {"type": "string", "maxLength": 262144, "description": "A whole Dockerfile instead of from_template/run/packages."},
                    "build_args": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Values of the Dockerfile's ARGs."},
                    "env": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Environment of sandboxes made from it."},
                    "workdir": {"type": "string", "description": "The default working directory of their commands (absolute)."},
                    "user": {"type": "string", "description": "The default user of their commands."},
                    "start_cmd": {"type": "string", "description": "A command started in the background when a sandbox is created from it (a server)."},
                    "network": network("the build's machine"),
                    "timeout_s": {"type": "integer", "minimum": 10, "maximum": 7200, "default": 1200,
                                  "description": "How long to wait for the build."}
                }),
                &["name"],
            ),
            json!({"type": "object",
                   "properties": {"template": template_schema(), "build_id": {"type": "string"},
                                  "log_tail": {"type": "array", "items": {"type": "string"}}},
                   "required": ["template", "build_id"]}),
            ann("Build a template", false, false, true),
        ),
        tool(
            "template_list",
            "List the templates you can start sandboxes and runs from: yours (built with \
template_build) and the shared `default` (Debian with python3, git, node, curl) and \
`code-interpreter` (Jupyter's Python kernel with numpy, pandas, matplotlib). Each with its \
digest, size and what its sandboxes get (env, workdir, user, start_cmd).",
            input(json!({}), &[]),
            json!({"type": "object",
                   "properties": {"templates": {"type": "array", "items": template_schema()}},
                   "required": ["templates"]}),
            ann("List templates", true, false, true),
        ),
    ]
}
