//! The MCP server handler: carries out the tools of `tools.rs` by calling Locker's API.
//!
//! Owns the mapping from a tool call to API requests and from the answers to tool results.
//! Error policy: a command's exit status (non-zero, timeout, kill) is a result; `isError`
//! is set only when the platform could not do what was asked (an API error such as
//! not_found or quota_exceeded, invalid arguments, an edit whose old_str does not match),
//! and then the text says what failed and what to do.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::ServerHandler;
use serde_json::{json, Map, Value};

use crate::api::{Api, ApiRequest};
use crate::text::{insert, str_replace, tail};
use crate::tools;

/// Lines of context shown around an edit.
const SNIPPET_LINES: usize = 4;

/// Locker's MCP server: one per client connection (or per HTTP session).
#[derive(Clone)]
pub struct LockerMcp {
    api: Arc<dyn Api>,
    /// The key used when the request itself carries none (stdio: `LOCKER_API_KEY`).
    default_key: Option<String>,
    tools: Arc<Vec<rmcp::model::Tool>>,
}

/// A tool call that could not be carried out; becomes a result with `isError`.
#[derive(Debug)]
pub(crate) struct Fail(pub(crate) String);

impl<E: std::fmt::Display> From<E> for Fail {
    fn from(e: E) -> Self {
        Fail(e.to_string())
    }
}

pub(crate) type Out = Result<Value, Fail>;

impl LockerMcp {
    pub fn new(api: Arc<dyn Api>, default_key: Option<String>) -> Self {
        LockerMcp {
            api,
            default_key,
            tools: Arc::new(tools::all()),
        }
    }

    /// The key of this request: its own `Authorization: Bearer` (Streamable HTTP), else the
    /// configured one (stdio).
    fn key(&self, ctx: &RequestContext<RoleServer>) -> Option<String> {
        ctx.extensions
            .get::<http::request::Parts>()
            .and_then(|p| p.headers.get(http::header::AUTHORIZATION))
            .and_then(|h| h.to_str().ok())
            .and_then(|s| s.strip_prefix("Bearer "))
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .or_else(|| self.default_key.clone())
    }

    /// The Locker URL this request came to (Streamable HTTP: its `Host`), else the one the
    /// API client was configured with (stdio: `LOCKER_URL`).
    fn base(&self, ctx: &RequestContext<RoleServer>) -> Option<String> {
        ctx.extensions
            .get::<http::request::Parts>()
            .and_then(|p| p.headers.get(http::header::HOST))
            .and_then(|h| h.to_str().ok())
            .map(|h| format!("http://{h}"))
            .or_else(|| self.api.base_url().map(str::to_owned))
    }

    async fn dispatch(
        &self,
        name: &str,
        args: Map<String, Value>,
        key: Option<String>,
        base: Option<String>,
    ) -> Out {
        let tool = self
            .tools
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| Fail(format!("there is no tool {name:?}")))?;
        check_args(tool, &args)?;
        let c = Call {
            api: &*self.api,
            key,
            base,
            args: &args,
        };
        match name {
            "run" => c.run().await,
            "sandbox_create" => c.sandbox_create().await,
            "exec" => c.exec().await,
            "process_output" => c.process_output().await,
            "process_write_stdin" => c.process_write_stdin().await,
            "process_kill" => c.process_kill().await,
            "sandbox_delete" => c.sandbox_delete().await,
            "file_read" => c.file_read().await,
            "file_write" => c.file_write().await,
            "file_edit" => c.file_edit().await,
            "file_list" => c.file_list().await,
            "snapshot_create" => c.snapshot_create().await,
            "sandbox_fork" => c.sandbox_fork().await,
            "volume_create" => c.volume_create().await,
            "volume_list" => c.volume_list().await,
            "sandbox_list" => c.sandbox_list().await,
            "sandbox_set_ttl" => c.sandbox_set_ttl().await,
            "process_list" => c.process_list().await,
            "snapshot_list" => c.snapshot_list().await,
            "snapshot_delete" => c.snapshot_delete().await,
            "service_start" => c.service_start().await,
            "port_list" => c.port_list().await,
            "run_code" => c.run_code().await,
            "template_build" => c.template_build().await,
            "template_list" => c.template_list().await,
            _ => Err(Fail(format!("there is no tool {name:?}"))),
        }
    }
}

/// Checks the arguments against the schema's property names and required list (the
/// schema's `additionalProperties: false`, enforced here too: clients do not all check).
fn check_args(tool: &rmcp::model::Tool, args: &Map<String, Value>) -> Result<(), Fail> {
    let props = tool
        .input_schema
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    for k in args.keys() {
        if !props.contains_key(k) {
            let known: Vec<&str> = props.keys().map(String::as_str).collect();
            return Err(Fail(format!(
                "unknown argument `{k}` for {}; it takes: {}",
                tool.name,
                known.join(", ")
            )));
        }
    }
    if let Some(req) = tool.input_schema.get("required").and_then(Value::as_array) {
        for r in req.iter().filter_map(Value::as_str) {
            if args.get(r).is_none_or(Value::is_null) {
                return Err(Fail(format!("{} needs the argument `{r}`", tool.name)));
            }
        }
    }
    for (k, v) in args {
        if let Some(allowed) = props[k].get("enum").and_then(Value::as_array) {
            if !allowed.contains(v) {
                return Err(Fail(format!(
                    "`{k}` must be one of {}",
                    Value::from(allowed.clone())
                )));
            }
        }
    }
    Ok(())
}

impl ServerHandler for LockerMcp {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_instructions(tools::INSTRUCTIONS);
        info.server_info.name = "locker".into();
        info.server_info.version = env!("CARGO_PKG_VERSION").into();
        info.server_info.title = Some("Locker: disposable isolated machines".into());
        info
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items((*self.tools).clone()))
    }

    fn get_tool(&self, name: &str) -> Option<rmcp::model::Tool> {
        // None: rmcp would validate structured output itself; our schemas are checked by tests.
        let _ = name;
        None
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if !self.tools.iter().any(|t| t.name == request.name) {
            return Err(ErrorData::invalid_params(
                format!("unknown tool {:?}", request.name),
                None,
            ));
        }
        let key = self.key(&context);
        let base = self.base(&context);
        let args = request.arguments.unwrap_or_default();
        let started = Instant::now();
        let out = self.dispatch(&request.name, args, key, base).await;
        tracing::debug!(tool = %request.name, ok = out.is_ok(), ms = started.elapsed().as_millis() as u64, "mcp tool call");
        Ok(match out {
            Ok(v) => CallToolResult::structured(v),
            Err(Fail(msg)) => CallToolResult::error(vec![ContentBlock::text(msg)]),
        }
        .into())
    }
}

/// One tool call in progress.
pub(crate) struct Call<'a> {
    api: &'a dyn Api,
    key: Option<String>,
    /// The Locker URL the client used (`http://host:port`), for URLs handed back.
    pub(crate) base: Option<String>,
    pub(crate) args: &'a Map<String, Value>,
}

/// `{"error": {"code", "message"}}` → "not_found: sandbox sb_1 does not exist".
pub(crate) fn api_error_text(status: u16, body: &[u8]) -> String {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let code = v["error"]["code"].as_str().unwrap_or("error");
    let msg = v["error"]["message"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(500)]).into_owned());
    format!("{code} (HTTP {status}): {msg}")
}

/// Percent-encodes a query value.
pub(crate) fn enc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                o.push(b as char)
            }
            _ => o.push_str(&format!("%{b:02X}")),
        }
    }
    o
}

/// A path segment (ids and names are plain already; refuse anything that would escape it).
pub(crate) fn seg(s: &str) -> Result<&str, Fail> {
    if s.is_empty() || s.contains(['/', '?', '#', '%']) || s == "." || s == ".." {
        return Err(Fail(format!("{s:?} is not a valid id or name")));
    }
    Ok(s)
}

impl Call<'_> {
    pub(crate) fn str(&self, k: &str) -> Option<&str> {
        self.args.get(k).and_then(Value::as_str)
    }
    pub(crate) fn need(&self, k: &str) -> Result<&str, Fail> {
        self.str(k)
            .ok_or_else(|| Fail(format!("`{k}` must be a string")))
    }
    pub(crate) fn u64(&self, k: &str) -> Result<Option<u64>, Fail> {
        match self.args.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| Fail(format!("`{k}` must be a non-negative integer"))),
        }
    }
    fn i64(&self, k: &str) -> Result<Option<i64>, Fail> {
        match self.args.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_i64()
                .map(Some)
                .ok_or_else(|| Fail(format!("`{k}` must be an integer"))),
        }
    }
    fn bool(&self, k: &str) -> bool {
        self.args.get(k).and_then(Value::as_bool).unwrap_or(false)
    }
    /// Copies the listed arguments (when given) into a JSON body.
    pub(crate) fn pick(&self, keys: &[&str]) -> Map<String, Value> {
        keys.iter()
            .filter_map(|k| {
                self.args
                    .get(*k)
                    .filter(|v| !v.is_null())
                    .map(|v| ((*k).to_owned(), v.clone()))
            })
            .collect()
    }

    pub(crate) async fn raw(
        &self,
        method: Method,
        path: String,
        content_type: Option<&'static str>,
        body: Bytes,
    ) -> Result<(u16, Bytes), Fail> {
        let resp = self
            .api
            .send(ApiRequest {
                method,
                path,
                key: self.key.clone(),
                content_type,
                body,
            })
            .await?;
        Ok((resp.status, resp.body))
    }

    /// A JSON request; a non-2xx answer is a [`Fail`] with the API's message.
    pub(crate) async fn json(&self, method: Method, path: String, body: Option<Value>) -> Out {
        let (ct, b) = match body {
            Some(v) => (Some("application/json"), Bytes::from(v.to_string())),
            None => (None, Bytes::new()),
        };
        let (status, body) = self.raw(method, path, ct, b).await?;
        if !(200..300).contains(&status) {
            return Err(Fail(api_error_text(status, &body)));
        }
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&body)
            .map_err(|e| Fail(format!("the Locker server's answer is not JSON: {e}")))
    }

    /// `/v1/sandboxes/{id}` or `/v1/volumes/{name}`: where a file tool acts.
    fn file_base(&self) -> Result<String, Fail> {
        match (self.str("sandbox_id"), self.str("volume")) {
            (Some(sb), None) => Ok(format!("/v1/sandboxes/{}", seg(sb)?)),
            (None, Some(v)) => Ok(format!("/v1/volumes/{}", seg(v)?)),
            _ => Err(Fail(
                "give exactly one of `sandbox_id` (a sandbox's files) and `volume` (a volume's files)"
                    .into(),
            )),
        }
    }

    pub(crate) fn exec_body(&self) -> Result<Map<String, Value>, Fail> {
        match (self.args.get("shell"), self.args.get("cmd")) {
            (Some(_), Some(_)) => {
                return Err(Fail(
                    "give either `shell` (a command line) or `cmd` (an argv array), not both"
                        .into(),
                ))
            }
            (None, None) => {
                return Err(Fail(
                    "give `shell` (a command line for /bin/sh -c) or `cmd` (an argv array)".into(),
                ))
            }
            _ => {}
        }
        Ok(self.pick(&[
            "shell",
            "cmd",
            "cwd",
            "env",
            "stdin",
            "timeout_ms",
            "max_output_bytes",
        ]))
    }

    async fn run(&self) -> Out {
        let vol = seg(self.need("volume")?)?.to_owned();
        let mut body = self.exec_body()?;
        body.extend(self.pick(&[
            "commit",
            "template",
            "memory_mb",
            "cpus",
            "network",
            "secrets",
        ]));
        if self.bool("create_volume") {
            let (status, b) = self
                .raw(
                    Method::GET,
                    format!("/v1/volumes/{vol}"),
                    None,
                    Bytes::new(),
                )
                .await?;
            if status == 404 {
                let mut v = json!({"name": vol});
                if let Some(s) = self.u64("size_mb")? {
                    v["size_mb"] = s.into();
                }
                self.json(Method::POST, "/v1/volumes".into(), Some(v))
                    .await
                    .map_err(|Fail(m)| Fail(format!("creating volume {vol:?}: {m}")))?;
            } else if !(200..300).contains(&status) {
                return Err(Fail(api_error_text(status, &b)));
            }
        }
        let (status, b) = self
            .raw(
                Method::POST,
                format!("/v1/volumes/{vol}/run"),
                Some("application/json"),
                Bytes::from(Value::Object(body).to_string()),
            )
            .await?;
        if !(200..300).contains(&status) {
            let msg = api_error_text(status, &b);
            if status == 404 && msg.contains("no such route") {
                return Err(Fail(format!(
                    "this Locker server does not serve runs yet ({msg}); use sandbox_create + exec instead"
                )));
            }
            return Err(Fail(msg));
        }
        Ok(serde_json::from_slice(&b)?)
    }

    async fn sandbox_create(&self) -> Out {
        let body = self.pick(&[
            "template",
            "cpus",
            "memory_mb",
            "disk_mb",
            "ttl_s",
            "idle_timeout_s",
            "env",
            "network",
            "secrets",
            "from_snapshot",
            "metadata",
        ]);
        self.json(
            Method::POST,
            "/v1/sandboxes".into(),
            Some(Value::Object(body)),
        )
        .await
    }

    async fn exec(&self) -> Out {
        let sb = seg(self.need("sandbox_id")?)?.to_owned();
        let body = Value::Object(self.exec_body()?);
        if self.bool("background") {
            let v = self
                .json(
                    Method::POST,
                    format!("/v1/sandboxes/{sb}/processes"),
                    Some(body),
                )
                .await?;
            return Ok(json!({"process_id": v["id"], "pid": v["pid"], "sandbox_id": sb}));
        }
        self.json(Method::POST, format!("/v1/sandboxes/{sb}/exec"), Some(body))
            .await
    }

    fn proc_path(&self) -> Result<String, Fail> {
        let sb = seg(self.need("sandbox_id")?)?;
        let p = seg(self.need("process_id")?)?;
        Ok(format!("/v1/sandboxes/{sb}/processes/{p}"))
    }

    async fn process_output(&self) -> Out {
        let base = self.proc_path()?;
        let wait = Duration::from_millis(self.u64("wait_ms")?.unwrap_or(0).min(60_000));
        let cap = self.u64("max_output_bytes")?.unwrap_or(65_536) as usize;
        let deadline = Instant::now() + wait;
        let mut info = self.json(Method::GET, base.clone(), None).await?;
        while info["state"] == "running" && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            info = self.json(Method::GET, base.clone(), None).await?;
        }
        let (status, b) = self
            .raw(Method::GET, format!("{base}/output"), None, Bytes::new())
            .await?;
        if !(200..300).contains(&status) {
            return Err(Fail(api_error_text(status, &b)));
        }
        let (mut out, mut err) = (Vec::new(), Vec::new());
        for line in b.split(|c| *c == b'\n').filter(|l| !l.is_empty()) {
            let Ok(v) = serde_json::from_slice::<Value>(line) else {
                continue;
            };
            match v["type"].as_str() {
                Some("stdout") => {
                    out.extend_from_slice(v["data"].as_str().unwrap_or("").as_bytes())
                }
                Some("stderr") => {
                    err.extend_from_slice(v["data"].as_str().unwrap_or("").as_bytes())
                }
                Some("error") => return Err(Fail(format!("reading the output: {}", v["error"]))),
                _ => {}
            }
        }
        let (stdout, st) = tail(&out, cap);
        let (stderr, et) = tail(&err, cap);
        let mut result = info.get("result").cloned().unwrap_or(Value::Null);
        if let Some(r) = result.as_object_mut() {
            // The bodies are already above; keep the result small.
            r.remove("stdout");
            r.remove("stderr");
        }
        Ok(json!({
            "process_id": info["id"],
            "state": if info["state"] == "running" { "running" } else { "exited" },
            "stdout": stdout, "stderr": stderr,
            "stdout_truncated": st, "stderr_truncated": et,
            "stdout_bytes": out.len(), "stderr_bytes": err.len(),
            "result": result,
        }))
    }

    async fn process_write_stdin(&self) -> Out {
        let base = self.proc_path()?;
        let data = self.need("data")?.to_owned();
        let close = self.bool("close");
        let (status, b) = self
            .raw(
                Method::POST,
                format!("{base}/stdin?close={close}"),
                Some("application/octet-stream"),
                Bytes::from(data.clone()),
            )
            .await?;
        if !(200..300).contains(&status) {
            return Err(Fail(api_error_text(status, &b)));
        }
        Ok(
            json!({"process_id": self.need("process_id")?, "written_bytes": data.len(), "closed": close}),
        )
    }

    async fn process_kill(&self) -> Out {
        let base = self.proc_path()?;
        let sig = self.str("signal").unwrap_or("SIGTERM").to_owned();
        self.json(
            Method::POST,
            format!("{base}/signal"),
            Some(json!({"signal": sig})),
        )
        .await?;
        Ok(json!({"process_id": self.need("process_id")?, "signal": sig}))
    }

    async fn sandbox_delete(&self) -> Out {
        let sb = seg(self.need("sandbox_id")?)?.to_owned();
        let deleted = self.delete(format!("/v1/sandboxes/{sb}")).await?;
        Ok(json!({"sandbox_id": sb, "deleted": deleted}))
    }

    /// A DELETE that is safe to repeat: whether the thing existed (404 is `false`, not a
    /// failure; another tenant's thing is a 404 too, so nothing leaks).
    pub(crate) async fn delete(&self, path: String) -> Result<bool, Fail> {
        let (status, b) = self.raw(Method::DELETE, path, None, Bytes::new()).await?;
        match status {
            200..=299 => Ok(true),
            404 if !api_error_text(status, &b).contains("no such route") => Ok(false),
            _ => Err(Fail(api_error_text(status, &b))),
        }
    }

    /// The file's bytes.
    async fn get_file(&self, base: &str, path: &str) -> Result<Bytes, Fail> {
        let (status, b) = self
            .raw(
                Method::GET,
                format!("{base}/files?path={}", enc(path)),
                None,
                Bytes::new(),
            )
            .await?;
        if !(200..300).contains(&status) {
            return Err(Fail(api_error_text(status, &b)));
        }
        Ok(b)
    }

    async fn put_file(&self, base: &str, path: &str, mode: Option<&str>, data: Bytes) -> Out {
        let mut q = format!("{base}/files?path={}", enc(path));
        if let Some(m) = mode {
            q.push_str(&format!("&mode={}", enc(m)));
        }
        let (status, b) = self
            .raw(Method::PUT, q, Some("application/octet-stream"), data)
            .await?;
        if !(200..300).contains(&status) {
            return Err(Fail(api_error_text(status, &b)));
        }
        Ok(serde_json::from_slice(&b)?)
    }

    async fn file_read(&self) -> Out {
        let base = self.file_base()?;
        let path = self.need("path")?;
        let bytes = self.get_file(&base, path).await?;
        let binary = std::str::from_utf8(&bytes).is_err();
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.split_inclusive('\n').collect();
        let total = lines.len() as i64;
        let start = self.i64("start_line")?.unwrap_or(1).max(1);
        let end = match self.i64("end_line")?.unwrap_or(-1) {
            -1 => total,
            e if e < start => {
                return Err(Fail(format!("end_line {e} is before start_line {start}")))
            }
            e => e.min(total),
        };
        if start > total.max(1) {
            return Err(Fail(format!(
                "start_line {start} is past the end: the file has {total} lines"
            )));
        }
        let max = self.u64("max_bytes")?.unwrap_or(65_536) as usize;
        let numbered = self.bool("line_numbers");
        let mut content = String::new();
        let mut last = start - 1;
        let mut truncated = false;
        for n in start..=end {
            let l = lines[(n - 1) as usize];
            let piece = if numbered {
                format!("{n}\t{l}")
            } else {
                l.to_owned()
            };
            if content.len() + piece.len() > max && n > start {
                truncated = true;
                break;
            }
            if piece.len() > max {
                // One line longer than the budget: cut it (on a char boundary).
                let mut cut = max;
                while !piece.is_char_boundary(cut) {
                    cut -= 1;
                }
                content.push_str(&piece[..cut]);
                truncated = true;
                last = n;
                break;
            }
            content.push_str(&piece);
            last = n;
        }
        let next = (truncated || last < end).then_some(last + 1);
        Ok(json!({
            "path": path, "content": content,
            "start_line": start, "end_line": last, "total_lines": total,
            "size_bytes": bytes.len(), "truncated": truncated,
            "next_start_line": if truncated { next } else { None },
            "binary": binary,
        }))
    }

    async fn file_write(&self) -> Out {
        let base = self.file_base()?;
        let path = self.need("path")?;
        let content = self.need("content")?;
        self.put_file(
            &base,
            path,
            self.str("mode"),
            Bytes::from(content.to_owned()),
        )
        .await
    }

    async fn file_edit(&self) -> Out {
        let base = self.file_base()?;
        let path = self.need("path")?;
        let command = self.need("command")?;
        let new_str = self.need("new_str")?;
        let bytes = self.get_file(&base, path).await?;
        let text = String::from_utf8(bytes.to_vec()).map_err(|_| {
            Fail(format!(
                "{path} is not UTF-8 text; file_edit edits text files only (use file_write or exec)"
            ))
        })?;
        let (new_text, line) = match command {
            "str_replace" => {
                if self.args.contains_key("insert_line") {
                    return Err(Fail(
                        "insert_line is for command=insert; str_replace uses old_str and new_str"
                            .into(),
                    ));
                }
                let old = self.str("old_str").ok_or_else(|| {
                    Fail("str_replace needs `old_str`: the exact text to replace".into())
                })?;
                str_replace(&text, old, new_str).map_err(|e| Fail(format!("{path}: {e}")))?
            }
            "insert" => {
                if self.args.contains_key("old_str") {
                    return Err(Fail(
                        "old_str is for command=str_replace; insert uses insert_line and new_str"
                            .into(),
                    ));
                }
                let at = self
                    .u64("insert_line")?
                    .ok_or_else(|| Fail("insert needs `insert_line` (0 = at the top)".into()))?;
                insert(&text, at as usize, new_str).map_err(|e| Fail(format!("{path}: {e}")))?
            }
            other => return Err(Fail(format!("unknown command {other:?}"))),
        };
        // Keep the permission bits: stat first, then write with the same mode.
        let st = self
            .json(
                Method::GET,
                format!("{base}/files/stat?path={}", enc(path)),
                None,
            )
            .await?;
        let mode = st["mode"].as_u64().map(|m| format!("{:o}", m & 0o7777));
        self.put_file(&base, path, mode.as_deref(), Bytes::from(new_text.clone()))
            .await?;
        let lines: Vec<&str> = new_text.lines().collect();
        let inserted = new_str.lines().count().max(1);
        let from = line.saturating_sub(SNIPPET_LINES).max(1);
        let to = (line + inserted + SNIPPET_LINES).min(lines.len());
        let snippet: String = (from..=to)
            .filter_map(|n| lines.get(n - 1).map(|l| format!("{n}\t{l}\n")))
            .collect();
        Ok(
            json!({"path": path, "command": command, "line": line, "snippet": snippet, "total_lines": lines.len()}),
        )
    }

    async fn file_list(&self) -> Out {
        let base = self.file_base()?;
        let path = self.need("path")?;
        let depth = self.u64("depth")?.unwrap_or(1);
        self.json(
            Method::GET,
            format!("{base}/files/list?path={}&depth={depth}", enc(path)),
            None,
        )
        .await
    }

    async fn snapshot_create(&self) -> Out {
        let sb = seg(self.need("sandbox_id")?)?.to_owned();
        self.json(Method::POST, format!("/v1/sandboxes/{sb}/snapshots"), None)
            .await
    }

    async fn sandbox_fork(&self) -> Out {
        let sb = seg(self.need("sandbox_id")?)?.to_owned();
        let count = self.u64("count")?.unwrap_or(1);
        self.json(
            Method::POST,
            format!("/v1/sandboxes/{sb}/fork"),
            Some(json!({"count": count})),
        )
        .await
    }

    async fn volume_create(&self) -> Out {
        let body = self.pick(&["name", "size_mb"]);
        self.json(
            Method::POST,
            "/v1/volumes".into(),
            Some(Value::Object(body)),
        )
        .await
    }

    async fn volume_list(&self) -> Out {
        self.json(Method::GET, "/v1/volumes".into(), None).await
    }
}
