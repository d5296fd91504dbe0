//! The code interpreter's shapes: the request bodies clients send, and what the driver in
//! the machine answers, parsed into the contract's types before anything is relayed.
//!
//! What the driver sends is hostile input (user code can kill it and listen on its port):
//! each line is parsed into these types with unknown types refused, and the line reader
//! caps a line's size, so nothing but the contract's shapes ever reaches a client.

use std::collections::BTreeMap;

use bytes::{Buf, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::ApiError;

/// The languages a context may have: the contract's three, and those of E2B's
/// code-interpreter template. Each needs its kernel in the sandbox (an installed kernelspec,
/// or what Locker's own kernel for it runs on: `driver.py`, KERNELS).
pub const LANGUAGES: &[&str] = &["python", "javascript", "typescript", "bash", "r", "java"];
/// The largest line the driver may send: a whole Execution with its capped output and results.
pub const MAX_LINE: usize = 128 << 20;
/// The largest `code` a call may carry.
pub const MAX_CODE: usize = 4 << 20;
/// The longest `timeout_ms` a call may ask for (one day).
pub const MAX_TIMEOUT_MS: u64 = 86_400_000;
/// The default timeout of a cell.
pub const DEFAULT_TIMEOUT_MS: u64 = 60_000;

/// `POST /v1/sandboxes/{id}/contexts`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewContext {
    #[serde(default)]
    pub language: Option<String>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Where the context starts when `cwd` is not given, if that is a directory in the
    /// machine (else `$HOME`); not part of the API: E2B's layer sets `/home/user`.
    #[serde(skip)]
    pub home: Option<String>,
}

/// `POST /v1/sandboxes/{id}/code`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunCode {
    pub code: String,
    #[serde(default)]
    pub context: Option<String>,
    #[serde(default)]
    pub language: Option<String>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Per stream, like exec's: the head and the tail are kept.
    #[serde(default)]
    pub max_output_bytes: Option<u64>,
    /// [`NewContext::home`] for the language's default context, when this cell starts it.
    #[serde(skip)]
    pub home: Option<String>,
}

/// A context as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Context {
    pub id: String,
    pub language: String,
    pub cwd: String,
    pub created_at: String,
}

/// `GET …/contexts` as the driver answers it.
#[derive(Debug, Deserialize)]
pub struct ContextList {
    pub contexts: Vec<Context>,
}

/// One output of a cell, by MIME type (binary ones base64, as Jupyter sends them).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodeResult {
    pub is_main_result: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub html: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub markdown: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub svg: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub png: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jpeg: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pdf: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub javascript: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chart: Option<Value>,
    /// A DataFrame's columns (name → values), beside its `html` and `text`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// Some MIME value was over the result cap and left out.
    #[serde(default, skip_serializing_if = "is_false")]
    pub truncated: bool,
    /// MIME types the kernel sent that the contract has no field for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub other_types: Vec<String>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// An exception raised by the code (or the kernel's end, or the timeout).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodeError {
    pub name: String,
    pub value: String,
    /// The traceback as text, without terminal colours.
    pub traceback: String,
}

/// Why a cell ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    Finished,
    Error,
    Timeout,
    Interrupted,
    ContextDied,
}

/// Where a cell's time went, in milliseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Timings {
    /// From the request's arrival until the driver had it (includes starting the driver
    /// and the default context's kernel on first use).
    #[serde(default)]
    pub queue_ms: f64,
    /// The cell in the driver, waiting behind earlier cells of the context included.
    #[serde(default)]
    pub run_ms: f64,
    #[serde(default)]
    pub total_ms: f64,
}

/// A cell's whole answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Execution {
    pub execution_count: Option<i64>,
    pub stdout: String,
    pub stderr: String,
    #[serde(default)]
    pub stdout_truncated: bool,
    #[serde(default)]
    pub stderr_truncated: bool,
    pub results: Vec<CodeResult>,
    pub error: Option<CodeError>,
    pub reason: Reason,
    /// The context the cell ran in.
    pub context: String,
    #[serde(default)]
    pub timings: Timings,
}

/// One line of the driver's execute stream.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Line {
    Stdout {
        text: String,
    },
    Stderr {
        text: String,
    },
    Result(CodeResult),
    Error(CodeError),
    Execution(Execution),
    /// The job failed before or while running (the kernel would not start).
    Failure {
        status: u16,
        error: String,
    },
}

/// Reads a driver's body as lines, each at most [`MAX_LINE`] bytes.
pub struct LineReader<B> {
    body: B,
    buf: BytesMut,
    done: bool,
}

impl LineReader<Incoming> {
    pub fn new(body: Incoming) -> Self {
        Self {
            body,
            buf: BytesMut::new(),
            done: false,
        }
    }

    /// The next line, parsed; `None` at the end of the body.
    pub async fn next(&mut self) -> Result<Option<Line>, ApiError> {
        loop {
            if let Some(at) = self.buf.iter().position(|b| *b == b'\n') {
                let line = self.buf.split_to(at + 1);
                if line.len() <= 1 {
                    continue;
                }
                return serde_json::from_slice(&line[..line.len() - 1])
                    .map(Some)
                    .map_err(|e| garbled(&format!("a line it sent is not the driver's ({e})")));
            }
            if self.buf.len() > MAX_LINE {
                return Err(garbled("it sent a line over 128 MiB"));
            }
            if self.done {
                if self.buf.iter().all(u8::is_ascii_whitespace) {
                    return Ok(None);
                }
                self.buf.extend_from_slice(b"\n");
                continue;
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(mut data) = frame.into_data() {
                        while data.has_remaining() {
                            let chunk = data.chunk();
                            self.buf.extend_from_slice(chunk);
                            let n = chunk.len();
                            data.advance(n);
                        }
                    }
                }
                Some(Err(e)) => return Err(garbled(&format!("its answer broke off ({e})"))),
                None => self.done = true,
            }
        }
    }
}

/// What the sandbox's port answered is not the code driver's protocol.
pub fn garbled(why: &str) -> ApiError {
    ApiError::bad_gateway(format!(
        "the code interpreter's driver in the sandbox did not answer properly: {why}; \
         its context may be lost (was it killed or its port taken?): retry, or restart the context"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(s: &str) -> Result<Line, serde_json::Error> {
        serde_json::from_str(s)
    }

    #[test]
    fn the_drivers_lines_parse_into_the_contract_and_nothing_else() {
        assert!(matches!(
            line(r#"{"type":"stdout","text":"hi\n"}"#),
            Ok(Line::Stdout { .. })
        ));
        let r = line(r#"{"type":"result","is_main_result":true,"text":"2","png":"iVBO"}"#);
        let Ok(Line::Result(r)) = r else {
            panic!("{r:?}")
        };
        assert_eq!(r.png.as_deref(), Some("iVBO"));
        let e = line(
            r#"{"type":"execution","execution_count":3,"stdout":"","stderr":"","results":[],
                "error":{"name":"ValueError","value":"x","traceback":"tb"},"reason":"error",
                "context":"ctx_a","timings":{"run_ms":1.5}}"#,
        );
        let Ok(Line::Execution(e)) = e else {
            panic!("{e:?}")
        };
        assert_eq!(e.reason, Reason::Error);
        assert_eq!(e.timings.run_ms, 1.5);
        for bad in [
            r#"{"type":"stdout","text":5}"#,
            r#"{"type":"shell","cmd":"rm -rf /"}"#,
            r#"{"type":"result","is_main_result":true,"extra":"x"}"#,
            r#"{"type":"execution","reason":"exploded"}"#,
            r#"not json"#,
        ] {
            assert!(line(bad).is_err(), "{bad}");
        }
        let out = serde_json::to_value(CodeResult {
            is_main_result: true,
            text: Some("1".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            out,
            serde_json::json!({"is_main_result": true, "text": "1"})
        );
    }

    #[test]
    fn requests_refuse_unknown_fields() {
        assert!(serde_json::from_str::<RunCode>(r#"{"code":"1","cwd":"/"}"#).is_err());
        assert!(serde_json::from_str::<NewContext>(r#"{"lang":"python"}"#).is_err());
        let r: RunCode = serde_json::from_str(r#"{"code":"1"}"#).unwrap();
        assert!(r.context.is_none() && r.env.is_empty());
    }
}
