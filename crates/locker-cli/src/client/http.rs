//! The one place the CLI speaks HTTP: base URL, Bearer key, status checks, and the
//! contract's error shape `{"error": {"code", "message"}}` turned into a [`ClientError`].
//!
//! Plain `http://` only: the CLI talks to a server on this host or behind the operator's
//! own TLS proxy, so it carries no TLS stack. Proxies from the environment are ignored
//! (a `HTTP_PROXY` meant for the internet must not swallow requests to localhost), and
//! redirects are not followed (the API never redirects; a redirect means a wrong URL).

use std::io::{self, Read};
use std::time::Duration;

use serde_json::Value;
use ureq::http::Response;
use ureq::{AsSendBody, Body, BodyReader};

/// The biggest error body read back from a failed request.
const MAX_ERROR_BODY: u64 = 64 * 1024;

/// Which key a client sends: tenant routes take an API key, admin routes the admin key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// `LOCKER_API_KEY`: a key of one tenant, for every `/v1` route of that tenant.
    Tenant,
    /// `LOCKER_ADMIN_KEY`: the key `locker serve --admin-key` was given.
    Admin,
}

impl KeyKind {
    /// The environment variable that holds this kind of key.
    pub fn env_var(self) -> &'static str {
        match self {
            KeyKind::Tenant => "LOCKER_API_KEY",
            KeyKind::Admin => "LOCKER_ADMIN_KEY",
        }
    }

    /// The command-line flag that gives this kind of key.
    pub fn flag(self) -> &'static str {
        match self {
            KeyKind::Tenant => "--api-key",
            KeyKind::Admin => "--admin-key",
        }
    }

    /// The key in this kind's environment variable, if it is set and not blank.
    pub fn key_in_env(self) -> Option<String> {
        std::env::var(self.env_var())
            .ok()
            .filter(|k| !k.trim().is_empty())
    }
}

/// Everything that can go wrong in a client command; each displays as one line.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing answers at the URL (connection refused, unknown host, connect timeout).
    #[error("cannot reach the Locker server at {url}: is `locker serve` running?")]
    Unreachable { url: String },
    /// The server answered with the contract's error body.
    #[error("{}", api_line(message, *status, code, hint.as_deref()))]
    Api {
        status: u16,
        code: String,
        message: String,
        /// What the user can do about it, when the CLI knows better than the server.
        hint: Option<String>,
    },
    /// An error status without the contract's error body: not a Locker server, or a proxy.
    #[error("{url} answered HTTP {status} without a Locker error{}", snippet(body))]
    Status {
        url: String,
        status: u16,
        body: String,
    },
    /// The exchange broke on the way (reset, timeout, malformed HTTP).
    #[error("request to {url} failed: {detail}")]
    Transport { url: String, detail: String },
    /// The server's answer does not have the contract's shape.
    #[error("unexpected answer from the server: {0}")]
    Protocol(String),
    /// A local file or stream failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    /// The command line asks for something that cannot work (exit code 2).
    #[error("{0}")]
    Usage(String),
    /// A setting the command needs is missing.
    #[error("{0}")]
    Config(String),
    /// The server reported a failure in the middle of a stream (the terminal's agent
    /// failed, the connection dropped).
    #[error("{0}")]
    Failed(String),
    /// Whoever read our stdout stopped reading (`locker exec … | head`): stop quietly.
    #[error("stdout was closed")]
    BrokenPipe,
}

impl ClientError {
    /// A local I/O failure; a closed stdout pipe becomes [`ClientError::BrokenPipe`].
    pub fn io(what: impl Into<String>, source: io::Error) -> ClientError {
        if source.kind() == io::ErrorKind::BrokenPipe {
            return ClientError::BrokenPipe;
        }
        ClientError::Io {
            what: what.into(),
            source,
        }
    }

    /// The process exit code this error calls for: 2 for usage mistakes, 141 (like a
    /// process killed by SIGPIPE) for a closed stdout, 1 for everything else.
    pub fn exit_code(&self) -> i32 {
        match self {
            ClientError::Usage(_) => 2,
            ClientError::BrokenPipe => 141,
            _ => 1,
        }
    }
}

fn api_line(message: &str, status: u16, code: &str, hint: Option<&str>) -> String {
    match hint {
        Some(h) => format!("{message} ({status} {code}); {h}"),
        None => format!("{message} ({status} {code})"),
    }
}

fn snippet(body: &str) -> String {
    let first = body.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    if first.is_empty() {
        return String::new();
    }
    let short: String = first.trim().chars().take(200).collect();
    format!(": {short}")
}

/// Turns an error response (status and body) into the error a user sees. Pure, so the
/// wording can be tested without a server.
pub fn error_from_response(
    url: &str,
    status: u16,
    body: &[u8],
    kind: KeyKind,
    has_key: bool,
) -> ClientError {
    let parsed: Option<(String, String)> =
        serde_json::from_slice::<Value>(body).ok().and_then(|v| {
            let e = v.get("error")?;
            let code = e.get("code")?.as_str()?.to_string();
            let message = e
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            Some((code, message))
        });
    let Some((code, mut message)) = parsed else {
        return ClientError::Status {
            url: url.to_string(),
            status,
            body: String::from_utf8_lossy(body).into_owned(),
        };
    };
    if message.is_empty() {
        message = format!("the server refused the request with {code}");
    }
    let var = format!("{} (or {})", kind.env_var(), kind.flag());
    let hint = match status {
        401 if !has_key => Some(match kind {
            KeyKind::Tenant => format!(
                "set {var} to an API key of this server (`locker serve` prints one at its first start)"
            ),
            KeyKind::Admin => {
                format!("set {var} to the admin key `locker serve` was started with")
            }
        }),
        401 => Some(format!("check {var}")),
        _ => None,
    };
    ClientError::Api {
        status,
        code,
        message,
        hint,
    }
}

/// An HTTP client of one Locker server, holding the key it authenticates with.
#[derive(Clone)]
pub struct Client {
    base: String,
    key: Option<String>,
    kind: KeyKind,
    agent: ureq::Agent,
}

impl Client {
    /// A client of the server at `base_url` (`http://host:port`, no path needed), sending
    /// `key` as the Bearer token when given.
    pub fn new(base_url: &str, key: Option<String>, kind: KeyKind) -> Result<Client, ClientError> {
        let base = base_url.trim().trim_end_matches('/').to_string();
        if base.starts_with("https://") {
            return Err(ClientError::Usage(format!(
                "{base}: this CLI speaks plain http:// only; reach a TLS endpoint through a local proxy"
            )));
        }
        if !base.starts_with("http://") || base.len() <= "http://".len() {
            return Err(ClientError::Usage(format!(
                "the server URL {base:?} (--url or LOCKER_URL) is not an http:// URL (for example {})",
                super::DEFAULT_URL
            )));
        }
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .max_redirects(0)
            .timeout_connect(Some(Duration::from_secs(10)))
            .user_agent(concat!("locker-cli/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Ok(Client {
            base,
            key,
            kind,
            agent,
        })
    }

    /// The server's base URL, without a trailing slash.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The full URL of an API path (`/v1/…`).
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The value of the `Authorization` header, if there is a key.
    pub fn bearer(&self) -> Option<String> {
        self.key.as_ref().map(|k| format!("Bearer {}", k.trim()))
    }

    /// `GET path?query` → the JSON body.
    pub fn get_json(&self, path: &str, query: &[(&str, String)]) -> Result<Value, ClientError> {
        let url = self.url(path);
        let mut req = self.agent.get(&url).header("Accept", "application/json");
        for (k, v) in query {
            req = req.query(k, v);
        }
        if let Some(b) = self.bearer() {
            req = req.header("Authorization", b);
        }
        let resp = self.finish(&url, req.call())?;
        read_json(resp)
    }

    /// `POST path` with a JSON body → the JSON body (`null` for an empty answer).
    pub fn post_json(&self, path: &str, body: &Value) -> Result<Value, ClientError> {
        let url = self.url(path);
        let mut req = self.agent.post(&url).header("Accept", "application/json");
        if let Some(b) = self.bearer() {
            req = req.header("Authorization", b);
        }
        let resp = self.finish(&url, req.send_json(body))?;
        read_json(resp)
    }

    /// `PATCH path` with a JSON body → the JSON body.
    pub fn patch_json(&self, path: &str, body: &Value) -> Result<Value, ClientError> {
        let url = self.url(path);
        let mut req = self.agent.patch(&url).header("Accept", "application/json");
        if let Some(b) = self.bearer() {
            req = req.header("Authorization", b);
        }
        let resp = self.finish(&url, req.send_json(body))?;
        read_json(resp)
    }

    /// `PUT path` with a JSON body → the JSON body.
    pub fn put_json(&self, path: &str, body: &Value) -> Result<Value, ClientError> {
        let url = self.url(path);
        let mut req = self.agent.put(&url).header("Accept", "application/json");
        if let Some(b) = self.bearer() {
            req = req.header("Authorization", b);
        }
        let resp = self.finish(&url, req.send_json(body))?;
        read_json(resp)
    }

    /// `DELETE path?query`; any 2xx is success.
    pub fn delete(&self, path: &str, query: &[(&str, String)]) -> Result<(), ClientError> {
        let url = self.url(path);
        let mut req = self.agent.delete(&url);
        for (k, v) in query {
            req = req.query(k, v);
        }
        if let Some(b) = self.bearer() {
            req = req.header("Authorization", b);
        }
        self.finish(&url, req.call())?;
        Ok(())
    }

    /// `GET path?query` → the body as a stream, for bodies too big to hold (file reads).
    pub fn get_stream(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<BodyReader<'static>, ClientError> {
        self.get_stream_accept(path, query, "*/*")
    }

    /// `GET path?query` asking for `accept` → the body as a stream (NDJSON is read line by
    /// line as it arrives).
    pub fn get_stream_accept(
        &self,
        path: &str,
        query: &[(&str, String)],
        accept: &str,
    ) -> Result<BodyReader<'static>, ClientError> {
        let url = self.url(path);
        let mut req = self.agent.get(&url).header("Accept", accept);
        for (k, v) in query {
            req = req.query(k, v);
        }
        if let Some(b) = self.bearer() {
            req = req.header("Authorization", b);
        }
        let resp = self.finish(&url, req.call())?;
        Ok(resp.into_body().into_reader())
    }

    /// `PUT path?query` with a streamed body (a `File` is sent with its length, anything
    /// else chunked) → the JSON body.
    pub fn put_body(
        &self,
        path: &str,
        query: &[(&str, String)],
        body: impl AsSendBody,
    ) -> Result<Value, ClientError> {
        let url = self.url(path);
        let req = self.agent.put(&url);
        self.send_raw(&url, req, query, body)
    }

    /// `POST path?query` with a raw body streamed as it is read (chunked) → the JSON body.
    pub fn post_body(
        &self,
        path: &str,
        query: &[(&str, String)],
        body: impl AsSendBody,
    ) -> Result<Value, ClientError> {
        let url = self.url(path);
        let req = self.agent.post(&url);
        self.send_raw(&url, req, query, body)
    }

    fn send_raw(
        &self,
        url: &str,
        req: ureq::RequestBuilder<ureq::typestate::WithBody>,
        query: &[(&str, String)],
        body: impl AsSendBody,
    ) -> Result<Value, ClientError> {
        let mut req = req
            .header("Accept", "application/json")
            .header("Content-Type", "application/octet-stream");
        for (k, v) in query {
            req = req.query(k, v);
        }
        if let Some(b) = self.bearer() {
            req = req.header("Authorization", b);
        }
        let resp = self.finish(url, req.send(body))?;
        read_json(resp)
    }

    /// `POST path` with a JSON body, asking for `accept`; returns the answer's content type
    /// and its body as a stream (NDJSON streams are read line by line as they arrive).
    pub fn post_stream(
        &self,
        path: &str,
        body: &Value,
        accept: &str,
    ) -> Result<(String, BodyReader<'static>), ClientError> {
        let url = self.url(path);
        let mut req = self.agent.post(&url).header("Accept", accept);
        if let Some(b) = self.bearer() {
            req = req.header("Authorization", b);
        }
        let resp = self.finish(&url, req.send_json(body))?;
        let ctype = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_ascii_lowercase();
        Ok((ctype, resp.into_body().into_reader()))
    }

    /// The error a user sees for an error status answered at `url` (for callers that
    /// speak to the server outside this client, such as the shell's WebSocket).
    pub fn error_for(&self, url: &str, status: u16, body: &[u8]) -> ClientError {
        error_from_response(url, status, body, self.kind, self.key.is_some())
    }

    /// Maps a transport failure to the error a user sees.
    pub fn transport_error(&self, url: &str, e: ureq::Error) -> ClientError {
        match e {
            ureq::Error::Io(io) if is_unreachable(&io) => ClientError::Unreachable {
                url: self.base.clone(),
            },
            ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => ClientError::Unreachable {
                url: self.base.clone(),
            },
            ureq::Error::Timeout(ureq::Timeout::Connect | ureq::Timeout::Resolve) => {
                ClientError::Unreachable {
                    url: self.base.clone(),
                }
            }
            ureq::Error::BadUri(why) => ClientError::Usage(format!(
                "the server URL {:?} (--url or LOCKER_URL) does not make a valid URL: {why}",
                self.base
            )),
            other => ClientError::Transport {
                url: url.to_string(),
                detail: other.to_string(),
            },
        }
    }

    /// Maps a failed request or an error status to a [`ClientError`]; passes a 2xx through.
    fn finish(
        &self,
        url: &str,
        r: Result<Response<Body>, ureq::Error>,
    ) -> Result<Response<Body>, ClientError> {
        let mut resp = r.map_err(|e| self.transport_error(url, e))?;
        let status = resp.status().as_u16();
        if (200..300).contains(&status) {
            return Ok(resp);
        }
        let mut body = Vec::new();
        // The error body is best effort: a failed read still leaves the status to report.
        let _ = resp
            .body_mut()
            .as_reader()
            .take(MAX_ERROR_BODY)
            .read_to_end(&mut body);
        Err(self.error_for(url, status, &body))
    }
}

/// Whether a connect error means "nothing listens there".
pub fn is_unreachable(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::AddrNotAvailable
            | io::ErrorKind::TimedOut
    )
}

fn read_json(mut resp: Response<Body>) -> Result<Value, ClientError> {
    if resp.status().as_u16() == 204 {
        return Ok(Value::Null);
    }
    let mut buf = Vec::new();
    resp.body_mut()
        .with_config()
        .limit(64 * 1024 * 1024)
        .reader()
        .read_to_end(&mut buf)
        .map_err(|e| ClientError::Protocol(format!("reading the answer failed: {e}")))?;
    if buf.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    serde_json::from_slice(&buf)
        .map_err(|e| ClientError::Protocol(format!("the answer is not JSON ({e})")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_errors_become_one_line() {
        let body = br#"{"error":{"code":"not_found","message":"sandbox sb_12 does not exist"}}"#;
        let e = error_from_response("u", 404, body, KeyKind::Tenant, true);
        assert_eq!(
            e.to_string(),
            "sandbox sb_12 does not exist (404 not_found)"
        );
        assert_eq!(e.exit_code(), 1);
    }

    #[test]
    fn unauthorized_says_which_variable_to_set() {
        let body = br#"{"error":{"code":"unauthorized","message":"missing API key"}}"#;
        let e = error_from_response("u", 401, body, KeyKind::Tenant, false);
        assert!(e.to_string().contains("set LOCKER_API_KEY"), "{e}");
        let e = error_from_response("u", 401, body, KeyKind::Admin, true);
        assert!(
            e.to_string()
                .ends_with("check LOCKER_ADMIN_KEY (or --admin-key)"),
            "{e}"
        );
    }

    #[test]
    fn foreign_error_bodies_are_reported_with_their_first_line() {
        let e = error_from_response(
            "http://x/v1/a",
            502,
            b"\n<html>Bad gateway</html>\nmore",
            KeyKind::Tenant,
            true,
        );
        assert_eq!(
            e.to_string(),
            "http://x/v1/a answered HTTP 502 without a Locker error: <html>Bad gateway</html>"
        );
    }

    #[test]
    fn only_plain_http_urls_are_accepted() {
        assert!(Client::new("http://127.0.0.1:7070/", None, KeyKind::Tenant).is_ok());
        let e = Client::new("https://x", None, KeyKind::Tenant)
            .err()
            .unwrap();
        assert_eq!(e.exit_code(), 2);
        assert!(Client::new("127.0.0.1:7070", None, KeyKind::Tenant).is_err());
        let c = Client::new("http://h:1/", Some(" k ".into()), KeyKind::Tenant).unwrap();
        assert_eq!(c.url("/v1/x"), "http://h:1/v1/x");
        assert_eq!(c.bearer().unwrap(), "Bearer k");
    }

    #[test]
    fn connection_refused_says_is_the_server_running() {
        // A port nobody listens on: bind one, learn it, close it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let base = format!("http://127.0.0.1:{port}");
        let c = Client::new(&base, None, KeyKind::Tenant).unwrap();
        let e = c.get_json("/v1/sandboxes", &[]).err().unwrap();
        assert_eq!(
            e.to_string(),
            format!("cannot reach the Locker server at {base}: is `locker serve` running?")
        );
    }
}
