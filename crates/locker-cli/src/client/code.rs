//! `locker code SB 'print(1)'` and `locker code SB -f script.py`: one cell in a sandbox's code
//! context (`POST /v1/sandboxes/{id}/code`), its output streamed as it comes (NDJSON), each
//! result's text printed and its images saved where asked. Exits 0 when the cell finished,
//! 1 when it raised, timed out, was interrupted or its kernel died.
//!
//! A thin client: the kernels, caps and queueing are the server's.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;

use serde_json::{json, Value};

use super::{base64_decode, print_json, seg, ClientError, Conn};

/// The longest NDJSON line read (an Execution with its images).
const MAX_LINE: u64 = 256 << 20;

/// `locker code …`.
#[derive(clap::Args, Debug)]
pub struct CodeArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// The sandbox (sb_…); its template must have a Jupyter kernel (`code-interpreter`).
    pub sandbox: String,
    /// The code to run (or give --file).
    pub code: Option<String>,
    /// Run the code in FILE (`-` reads stdin).
    #[arg(long, short, conflicts_with = "code")]
    pub file: Option<PathBuf>,
    /// The context to run in (ctx_…); without it, the sandbox's default context of the
    /// language, which keeps its variables between calls.
    #[arg(long)]
    pub context: Option<String>,
    /// The language (python; javascript and bash need their kernels in the template).
    #[arg(long, default_value = "python")]
    pub language: String,
    /// Interrupt the cell after this many milliseconds (its context keeps its state).
    #[arg(long)]
    pub timeout_ms: Option<u64>,
    /// Save the cell's images (PNG, JPEG, SVG) in DIR as result-N.png … .
    #[arg(long, value_name = "DIR")]
    pub save_images: Option<PathBuf>,
}

/// Runs `locker code …`.
pub fn run(a: CodeArgs) -> Result<i32, ClientError> {
    let code = match (&a.code, &a.file) {
        (Some(c), None) => c.clone(),
        (None, Some(f)) if f.as_os_str() == "-" => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .map_err(|e| ClientError::io("cannot read the code from stdin", e))?;
            s
        }
        (None, Some(f)) => std::fs::read_to_string(f)
            .map_err(|e| ClientError::io(format!("cannot read {}", f.display()), e))?,
        _ => {
            return Err(ClientError::Usage(
                "give the code to run, or --file FILE (`-` for stdin)".into(),
            ))
        }
    };
    let mut body = json!({ "code": code, "language": a.language });
    if let Some(ctx) = &a.context {
        body["context"] = json!(ctx);
    }
    if let Some(t) = a.timeout_ms {
        body["timeout_ms"] = json!(t);
    }
    let c = a.conn.client()?;
    let path = format!("/v1/sandboxes/{}/code", seg(&a.sandbox));
    let (_, reader) = c.post_stream(&path, &body, "application/x-ndjson")?;
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    let mut images = Images {
        dir: a.save_images.clone(),
        saved: 0,
    };
    let quiet = a.conn.json;
    let execution = follow(
        BufReader::new(reader),
        quiet,
        &mut out,
        &mut err,
        &mut images,
    )?;
    if quiet {
        print_json(&execution)?;
    }
    let finished = execution.get("reason").and_then(Value::as_str) == Some("finished");
    Ok(if finished { 0 } else { 1 })
}

/// Where a cell's images go.
struct Images {
    dir: Option<PathBuf>,
    saved: usize,
}

impl Images {
    /// Saves the images of `result`; returns what to say of them.
    fn save(&mut self, result: &Value) -> Result<Vec<String>, ClientError> {
        let mut said = Vec::new();
        for (field, ext) in [("png", "png"), ("jpeg", "jpg"), ("svg", "svg")] {
            let Some(data) = result.get(field).and_then(Value::as_str) else {
                continue;
            };
            let Some(dir) = &self.dir else {
                said.push(format!("[{field} image: save it with --save-images DIR]"));
                continue;
            };
            let bytes = if field == "svg" {
                data.as_bytes().to_vec()
            } else {
                base64_decode(data).ok_or_else(|| {
                    ClientError::Protocol(format!("a result's `{field}` is not base64"))
                })?
            };
            self.saved += 1;
            let file = dir.join(format!("result-{}.{ext}", self.saved));
            std::fs::write(&file, bytes)
                .map_err(|e| ClientError::io(format!("cannot write {}", file.display()), e))?;
            said.push(format!("[{field} image saved: {}]", file.display()));
        }
        Ok(said)
    }
}

fn write(w: &mut impl Write, s: &str) -> Result<(), ClientError> {
    w.write_all(s.as_bytes())
        .and_then(|()| w.flush())
        .map_err(|e| ClientError::io("cannot write the cell's output", e))
}

/// Prints a cell's stream as it comes; returns its Execution (the last line).
fn follow(
    mut r: impl BufRead,
    quiet: bool,
    out: &mut impl Write,
    err: &mut impl Write,
    images: &mut Images,
) -> Result<Value, ClientError> {
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut r)
            .take(MAX_LINE)
            .read_until(b'\n', &mut line)
            .map_err(|e| ClientError::io("reading the cell's output failed", e))?;
        if n == 0 {
            return Err(ClientError::Protocol(
                "the cell's stream ended before its result (the server or the connection failed)"
                    .into(),
            ));
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let msg: Value = serde_json::from_slice(&line).map_err(|e| {
            ClientError::Protocol(format!("a line of the cell's stream is not JSON ({e})"))
        })?;
        let text = |k: &str| msg.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        match msg.get("type").and_then(Value::as_str).unwrap_or("") {
            "execution" => {
                if !quiet {
                    tail_note(&msg, err)?;
                }
                return Ok(msg);
            }
            _ if quiet => {}
            "stdout" => write(out, &text("text"))?,
            "stderr" => write(err, &text("text"))?,
            "result" => {
                let mut shown = images.save(&msg)?;
                if shown.is_empty() || msg.get("is_main_result") == Some(&Value::Bool(true)) {
                    shown.insert(0, text("text"));
                }
                for s in shown.into_iter().filter(|s| !s.is_empty()) {
                    write(out, &format!("{s}\n"))?;
                }
            }
            "error" if msg.get("error").is_some() => {
                let e = &msg["error"];
                return Err(ClientError::Protocol(format!(
                    "the cell failed: {}",
                    e.get("message").and_then(Value::as_str).unwrap_or("")
                )));
            }
            "error" => {
                let tb = text("traceback");
                let shown = if tb.is_empty() {
                    format!("{}: {}\n", text("name"), text("value"))
                } else {
                    format!("{tb}\n")
                };
                write(err, &shown)?;
            }
            _ => {}
        }
    }
}

/// What the stream did not show: output past the cap, and how the cell ended when it did
/// not finish or raise.
fn tail_note(execution: &Value, err: &mut impl Write) -> Result<(), ClientError> {
    for key in ["stdout", "stderr"] {
        if execution.get(format!("{key}_truncated")) == Some(&Value::Bool(true)) {
            write(
                err,
                &format!("locker: {key} was over the cap; its head and tail are in --json\n"),
            )?;
        }
    }
    let reason = execution
        .get("reason")
        .and_then(Value::as_str)
        .unwrap_or("");
    if matches!(reason, "timeout" | "interrupted" | "context_died") {
        let e = &execution["error"];
        write(
            err,
            &format!(
                "locker: {reason}: {}\n",
                e.get("value").and_then(Value::as_str).unwrap_or("")
            ),
        )?;
    }
    Ok(())
}
