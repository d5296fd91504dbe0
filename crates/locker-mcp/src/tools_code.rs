//! The code interpreter's tool, `run_code`: Python in a sandbox's code context (a Jupyter
//! kernel whose variables persist between calls), and how it is carried out: one
//! `POST /v1/sandboxes/{id}/code` through the same [`Call`] as every tool, its answer
//! trimmed to what a model re-reads every turn (output tails; images counted, not inlined).
//!
//! Owns this tool's name, description, schema and answer only.

use http::Method;
use rmcp::model::Tool;
use serde_json::{json, Value};

use crate::server::{seg, Call, Out};
use crate::tools::{ann, input, sandbox_id, tool};

/// What of a cell's stdout and stderr the model gets back (their tails).
const STDOUT_CHARS: usize = 8000;
const STDERR_CHARS: usize = 2000;

pub(crate) fn all() -> Vec<Tool> {
    vec![tool(
        "run_code",
        "Run Python in an isolated Linux sandbox and return stdout, stderr and any error. \
Variables and imports persist between calls on the same context, so build work up step by \
step. Use print(...) for anything you want to see; the value of the last expression comes back \
as `result`. The sandbox must come from sandbox_create with template \"code-interpreter\" \
(numpy, pandas, matplotlib, scipy, requests and pillow installed). Without `context` the \
sandbox's default Python context is used. A cell that runs past timeout_ms is interrupted and \
its variables are kept. A matplotlib chart (plt.show()) is counted in `images`: save it with \
plt.savefig('/root/chart.png') and read it with file_read if you need the file. An exception \
is a normal result (error with name, value and traceback) to read and fix; reason \
context_died means the interpreter crashed and the next call starts a fresh one.",
        input(
            json!({
                "sandbox_id": sandbox_id(),
                "code": {"type": "string", "description": "Python source, as in a notebook cell."},
                "context": {"type": "string", "pattern": "^ctx_[a-z0-9_]+$",
                            "description": "A context id (ctx_…); default: the sandbox's default Python context."},
                "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 600000, "default": 60000,
                               "description": "Wall-clock limit in milliseconds (default 60000)."}
            }),
            &["sandbox_id", "code"],
        ),
        json!({"type": "object",
               "properties": {
                   "stdout": {"type": "string"}, "stderr": {"type": "string"},
                   "error": {"type": ["object", "null"]},
                   "reason": {"type": "string", "enum": ["finished", "error", "timeout", "interrupted", "context_died"]},
                   "result": {"type": ["string", "null"]},
                   "images": {"type": "integer"},
                   "execution_count": {"type": ["integer", "null"]},
                   "context": {"type": "string"}
               },
               "required": ["stdout", "stderr", "error", "reason"]}),
        ann("Run Python code", false, false, false),
    )]
}

fn tail(s: &str, chars: usize) -> String {
    let n = s.chars().count();
    s.chars().skip(n.saturating_sub(chars)).collect()
}

impl Call<'_> {
    pub(crate) async fn run_code(&self) -> Out {
        let sb = seg(self.need("sandbox_id")?)?.to_owned();
        let mut body = json!({ "code": self.need("code")? });
        if let Some(ctx) = self.str("context") {
            body["context"] = json!(ctx);
        }
        if let Some(t) = self.u64("timeout_ms")? {
            body["timeout_ms"] = json!(t);
        }
        let v = self
            .json(Method::POST, format!("/v1/sandboxes/{sb}/code"), Some(body))
            .await?;
        let results = v["results"].as_array().cloned().unwrap_or_default();
        let images = results
            .iter()
            .filter(|r| r.get("png").is_some() || r.get("jpeg").is_some() || r.get("svg").is_some())
            .count();
        let result = results
            .iter()
            .find(|r| r["is_main_result"] == Value::Bool(true))
            .and_then(|r| r.get("text").cloned())
            .unwrap_or(Value::Null);
        let mut error = v["error"].clone();
        if let Some(tb) = error.get("traceback").and_then(Value::as_str) {
            error["traceback"] = json!(tail(tb, STDERR_CHARS));
        }
        Ok(json!({
            "stdout": tail(v["stdout"].as_str().unwrap_or(""), STDOUT_CHARS),
            "stderr": tail(v["stderr"].as_str().unwrap_or(""), STDERR_CHARS),
            "error": error,
            "reason": v["reason"],
            "result": result,
            "images": images,
            "execution_count": v["execution_count"],
            "context": v["context"],
        }))
    }
}
