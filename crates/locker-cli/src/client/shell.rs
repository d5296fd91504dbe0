//! `locker shell SB`: an interactive terminal in a sandbox over the WebSocket at
//! `GET /v1/sandboxes/{id}/pty`.
//!
//! Binary frames carry terminal bytes both ways; a text frame `{"resize":[cols,rows]}`
//! goes out at the start and whenever the local window changes. When the remote shell
//! ends, the server sends a text frame `{"type":"exit", …ExecResult}` (or
//! `{"type":"error","message"}`) before closing, and `locker shell` exits with the shell's
//! code, mapped as `locker exec` maps it. One thread drives it all
//! with `poll(2)` over stdin, the socket (non-blocking once the handshake is done) and the
//! signal pipe, so no byte waits behind another stream. The local terminal is raw while
//! the shell runs and restored on every way out (see [`super::tty`]).

use std::io::{self, IsTerminal, Write};
use std::net::TcpStream;

use serde_json::json;
use tungstenite::client::IntoClientRequest;
use tungstenite::handshake::HandshakeError;
use tungstenite::http::HeaderValue;
use tungstenite::{Message, WebSocket};

use super::http::is_unreachable;
use super::tty::{self, RawMode, Signals};
use super::{seg, Client, ClientError, Endpoint};

/// `locker shell …`.
#[derive(clap::Args, Debug)]
pub struct ShellArgs {
    #[command(flatten)]
    pub endpoint: Endpoint,
    /// The sandbox (sb_…).
    pub sandbox: String,
    /// A command to run in the terminal instead of a login shell (after `--`):
    /// `locker shell SB -- python3`.
    #[arg(
        value_name = "CMD",
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub cmd: Vec<String>,
}

/// `argv` as one `/bin/sh` command line: each word single-quoted, so nothing in it is
/// expanded by the shell that runs it.
pub fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|a| format!("'{}'", a.replace('\'', "'\\''")))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The WebSocket URL of an API path on the server at `base` (`http://h:p` → `ws://h:p…`),
/// and the `host:port` to connect to.
pub fn ws_target(base: &str, path: &str) -> Result<(String, String), ClientError> {
    let rest = base
        .strip_prefix("http://")
        .ok_or_else(|| ClientError::Usage(format!("{base} is not an http:// URL")))?;
    let authority = rest.split('/').next().unwrap_or(rest);
    if authority.is_empty() {
        return Err(ClientError::Usage(format!("{base} names no host")));
    }
    let has_port = match authority.rfind(']') {
        Some(close) => authority[close..].contains(':'),
        None => authority.contains(':'),
    };
    let addr = if has_port {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    Ok((format!("ws://{}{path}", rest.trim_end_matches('/')), addr))
}

/// The resize message for a window of `cols` × `rows`.
pub fn resize_message(cols: u16, rows: u16) -> String {
    json!({ "resize": [cols, rows] }).to_string()
}

fn ws_error(e: tungstenite::Error) -> ClientError {
    ClientError::Protocol(format!("the terminal connection failed: {e}"))
}

/// Opens the terminal WebSocket of `sandbox` (blocking; the handshake's error answer is
/// turned into the contract error it carries).
pub fn connect(
    c: &Client,
    sandbox: &str,
    cmd: Option<&str>,
) -> Result<WebSocket<TcpStream>, ClientError> {
    let mut path = format!("/v1/sandboxes/{}/pty", seg(sandbox));
    if let Some(cmd) = cmd {
        path.push_str("?cmd=");
        path.push_str(&seg(cmd));
    }
    let (url, addr) = ws_target(c.base_url(), &path)?;
    let mut req = url
        .as_str()
        .into_client_request()
        .map_err(|e| ClientError::Usage(format!("{url} is not a valid URL: {e}")))?;
    if let Some(b) = c.bearer() {
        let v = HeaderValue::from_str(&b).map_err(|_| {
            ClientError::Config("the API key holds characters a header cannot".into())
        })?;
        req.headers_mut().insert("Authorization", v);
    }
    let stream = TcpStream::connect(&addr).map_err(|e| {
        if is_unreachable(&e) {
            ClientError::Unreachable {
                url: c.base_url().to_string(),
            }
        } else {
            ClientError::Transport {
                url: url.clone(),
                detail: e.to_string(),
            }
        }
    })?;
    let _ = stream.set_nodelay(true);
    // A second handle on the socket: when the server refuses the upgrade, the handshake
    // has only read what came with the headers, and the error body may follow.
    let spare = stream
        .try_clone()
        .map_err(|e| ClientError::io("cannot set up the connection", e))?;
    match tungstenite::client(req, stream) {
        Ok((ws, _)) => Ok(ws),
        Err(HandshakeError::Failure(tungstenite::Error::Http(resp))) => {
            let status = resp.status().as_u16();
            let header = |k: &str| {
                resp.headers()
                    .get(k)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_ascii_lowercase)
            };
            let length = header("content-length").and_then(|v| v.trim().parse().ok());
            let chunked = header("transfer-encoding").is_some_and(|v| v.contains("chunked"));
            let mut body = resp.body().clone().unwrap_or_default();
            read_rest(&spare, &mut body, length, chunked);
            if chunked {
                body = dechunk(&body);
            }
            Err(c.error_for(&url, status, &body))
        }
        Err(HandshakeError::Failure(e)) => Err(ClientError::Transport {
            url,
            detail: e.to_string(),
        }),
        Err(HandshakeError::Interrupted(_)) => Err(ClientError::Transport {
            url,
            detail: "the handshake was interrupted".into(),
        }),
    }
}

/// The most of a refused upgrade's error body read back.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Reads the rest of an error body after the part that came with the headers: up to
/// `length` bytes when the server gave one, else to the end of a chunked body or of the
/// connection; bounded in size and in time (the body is only for the error message).
fn read_rest(mut s: &TcpStream, body: &mut Vec<u8>, length: Option<usize>, chunked: bool) {
    use std::io::Read;
    let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(2)));
    let mut buf = [0u8; 4096];
    loop {
        let done = match length {
            Some(n) => body.len() >= n,
            None => chunked && body.ends_with(b"0\r\n\r\n"),
        };
        if done || body.len() >= MAX_ERROR_BODY {
            return;
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => body.extend_from_slice(&buf[..n]),
        }
    }
}

/// The payload of a chunked HTTP body (as much of it as is well formed).
pub fn dechunk(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = raw;
    loop {
        let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_text = String::from_utf8_lossy(&rest[..eol]);
        let size_hex = size_text.split(';').next().unwrap_or("").trim();
        let Ok(size) = usize::from_str_radix(size_hex, 16) else {
            return out;
        };
        rest = &rest[eol + 2..];
        if size == 0 || rest.len() < size {
            out.extend_from_slice(&rest[..size.min(rest.len())]);
            return out;
        }
        out.extend_from_slice(&rest[..size]);
        rest = rest.get(size + 2..).unwrap_or(&[]);
    }
}

/// Runs `locker shell …`.
pub fn run(a: ShellArgs) -> Result<i32, ClientError> {
    let cmd = (!a.cmd.is_empty()).then(|| format!("exec {}", shell_words(&a.cmd)));
    terminal(&a.endpoint, &a.sandbox, cmd.as_deref())
}

/// A terminal in `sandbox` running `cmd` (a `/bin/sh` command line; a login shell when
/// `None`), with this process's terminal (or pipe) as its keyboard and screen; returns
/// the exit code to leave with.
pub fn terminal(endpoint: &Endpoint, sandbox: &str, cmd: Option<&str>) -> Result<i32, ClientError> {
    let c = endpoint.client()?;
    let ws = connect(&c, sandbox, cmd)?;
    let interactive = io::stdin().is_terminal();
    let signals = Signals::install().map_err(|e| ClientError::io("cannot watch signals", e))?;
    let raw = if interactive {
        Some(
            RawMode::enter(0)
                .map_err(|e| ClientError::io("cannot put the terminal in raw mode", e))?,
        )
    } else {
        None
    };
    let mut at_line_start = true;
    let code = pump(ws, interactive, &signals, &mut at_line_start);
    if interactive && !at_line_start {
        // Leave the local prompt (or our error line) at the start of a line.
        let _ = io::stdout().write_all(b"\r\n");
        let _ = io::stdout().flush();
    }
    drop(raw);
    code
}

/// A text frame from the server.
#[derive(Debug, PartialEq)]
pub enum Control {
    /// The remote shell ended; `locker shell` leaves with this code.
    Exit(i32),
    /// The terminal failed on the server's side.
    Error(String),
    /// Anything else (ignored, so the server can add messages).
    Other,
}

/// Reads a text frame: `{"type":"exit", …ExecResult}` or `{"type":"error","message"}`.
pub fn control_message(text: &str) -> Control {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(text) else {
        return Control::Other;
    };
    match v.get("type").and_then(|t| t.as_str()) {
        Some("exit") => Control::Exit(super::exec::exit_code_of(&v)),
        Some("error") => Control::Error(
            v.get("message")
                .and_then(|m| m.as_str())
                .unwrap_or("the terminal failed on the server")
                .to_string(),
        ),
        _ => Control::Other,
    }
}

/// How the shell ends once the connection is gone: the server's error if it sent one,
/// else the shell's exit code, else 0 after a clean close and an error after a cut one.
fn ending(exit: Option<i32>, failure: Option<String>, clean: bool) -> Result<i32, ClientError> {
    match (failure, exit) {
        (Some(m), _) => Err(ClientError::Failed(format!("the terminal failed: {m}"))),
        (None, Some(code)) => Ok(code),
        (None, None) if clean => Ok(0),
        (None, None) => Err(ClientError::Failed(
            "the connection to the server was lost".into(),
        )),
    }
}

/// Whether a tungstenite error only means "try again once the socket is ready".
fn would_block(e: &tungstenite::Error) -> bool {
    matches!(e, tungstenite::Error::Io(io) if io.kind() == io::ErrorKind::WouldBlock)
}

/// Sends `msg`; a full socket leaves it queued and returns `true` (a flush is pending).
fn send(ws: &mut WebSocket<TcpStream>, msg: Message) -> Result<bool, ClientError> {
    match ws.send(msg) {
        Ok(()) => Ok(false),
        Err(e) if would_block(&e) => Ok(true),
        Err(e) => Err(ws_error(e)),
    }
}

/// The shell loop: terminal bytes out, terminal bytes in, until the server closes.
/// `at_line_start` tells whether the last byte written to the terminal ended a line.
fn pump(
    mut ws: WebSocket<TcpStream>,
    interactive: bool,
    signals: &Signals,
    at_line_start: &mut bool,
) -> Result<i32, ClientError> {
    use std::os::fd::AsRawFd;
    let mut pending = false;
    if let Some((cols, rows)) = tty::window_size(0) {
        pending |= send(&mut ws, Message::text(resize_message(cols, rows)))?;
    }
    ws.get_mut()
        .set_nonblocking(true)
        .map_err(|e| ClientError::io("cannot set up the connection", e))?;
    let sock = ws.get_ref().as_raw_fd();
    let mut out = io::stdout().lock();
    let mut stdin_open = true;
    // Piped input waits for the remote side's first output (its prompt): bytes, and the
    // end-of-input Ctrl-D above all, that reach the terminal before the shell switched it
    // to raw mode can be flushed and lost, leaving the shell waiting forever.
    let mut remote_ready = interactive;
    let mut buf = vec![0u8; 16 * 1024];
    let mut exit: Option<i32> = None;
    let mut failure: Option<String> = None;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: sock,
                events: libc::POLLIN | if pending { libc::POLLOUT } else { 0 },
                revents: 0,
            },
            libc::pollfd {
                fd: signals.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                // A negative fd is skipped by poll: no new input while a send is queued.
                fd: if stdin_open && remote_ready && !pending {
                    0
                } else {
                    -1
                },
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        tty::poll(&mut fds, -1).map_err(|e| ClientError::io("poll failed", e))?;

        if fds[1].revents != 0 {
            let p = signals.take();
            if p.terminate {
                let _ = ws.close(None);
                let _ = ws.flush();
                return Ok(143);
            }
            if p.resized {
                if let Some((cols, rows)) = tty::window_size(0) {
                    pending |= send(&mut ws, Message::text(resize_message(cols, rows)))?;
                }
            }
        }
        if fds[0].revents != 0 {
            // Drain every whole frame tungstenite can read now: poll only sees the socket,
            // not what is already buffered.
            loop {
                match ws.read() {
                    Ok(Message::Binary(b)) => {
                        remote_ready = true;
                        if let Some(last) = b.last() {
                            *at_line_start = *last == b'\n';
                        }
                        out.write_all(&b)
                            .and_then(|()| out.flush())
                            .map_err(|e| ClientError::io("cannot write to the terminal", e))?;
                    }
                    Ok(Message::Text(t)) => match control_message(&t) {
                        Control::Exit(code) => exit = Some(code),
                        Control::Error(m) => failure = Some(m),
                        Control::Other => {}
                    },
                    Ok(_) => {}
                    Err(e) if would_block(&e) => break,
                    Err(
                        tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed,
                    ) => {
                        return ending(exit, failure, true);
                    }
                    Err(tungstenite::Error::Protocol(
                        tungstenite::error::ProtocolError::ResetWithoutClosingHandshake,
                    )) => return ending(exit, failure, false),
                    Err(e) => return Err(ws_error(e)),
                }
            }
            pending = false;
            match ws.flush() {
                Ok(()) => {}
                Err(e) if would_block(&e) => pending = true,
                Err(tungstenite::Error::ConnectionClosed) => return ending(exit, failure, true),
                Err(e) => return Err(ws_error(e)),
            }
        }
        if fds[2].revents != 0 {
            let n = tty::read_fd(0, &mut buf)
                .map_err(|e| ClientError::io("cannot read standard input", e))?;
            let input = if n == 0 {
                stdin_open = false;
                // A pipe ran dry: say end-of-input the way a terminal does (Ctrl-D), so a
                // piped script ends the remote shell when it is done.
                (!interactive).then(|| vec![4u8])
            } else {
                Some(buf[..n].to_vec())
            };
            if let Some(bytes) = input {
                match send(&mut ws, Message::binary(bytes)) {
                    Ok(p) => pending |= p,
                    // The server ended the terminal as this input left (it said how, and
                    // closed): that end stands, not the failed send.
                    Err(_) if exit.is_some() || failure.is_some() => {
                        return ending(exit, failure, true)
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn websocket_url_and_address_from_the_base_url() {
        assert_eq!(
            ws_target("http://127.0.0.1:7070", "/v1/sandboxes/sb_1/pty").unwrap(),
            (
                "ws://127.0.0.1:7070/v1/sandboxes/sb_1/pty".to_string(),
                "127.0.0.1:7070".to_string()
            )
        );
        assert_eq!(
            ws_target("http://localhost", "/p").unwrap(),
            ("ws://localhost/p".to_string(), "localhost:80".to_string())
        );
        assert_eq!(ws_target("http://[::1]:9/", "/p").unwrap().1, "[::1]:9");
        assert_eq!(ws_target("http://[::1]", "/p").unwrap().1, "[::1]:80");
        assert!(ws_target("http://", "/p").is_err());
    }

    #[test]
    fn chunked_error_bodies_are_reassembled() {
        let raw = b"5\r\n{\"err\r\n3;x=1\r\nor\"\r\n1\r\n}\r\n0\r\n\r\n";
        assert_eq!(dechunk(raw), b"{\"error\"}");
        assert_eq!(dechunk(b"a\r\nshort"), b"short");
        assert_eq!(dechunk(b"zz\r\n"), b"");
    }

    #[test]
    fn words_are_quoted_for_sh() {
        let w = |v: &[&str]| shell_words(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(
            w(&["python3", "-c", "print('a b')"]),
            r#"'python3' '-c' 'print('\''a b'\'')'"#
        );
        assert_eq!(w(&["$HOME", "`x`"]), "'$HOME' '`x`'");
    }

    #[test]
    fn the_shell_exit_code_comes_from_the_exit_message() {
        let exit = r#"{"type":"exit","exit_code":3,"reason":"exited","signal":null}"#;
        assert_eq!(control_message(exit), Control::Exit(3));
        let hup = r#"{"type":"exit","exit_code":null,"reason":"signaled","signal":"SIGHUP"}"#;
        assert_eq!(control_message(hup), Control::Exit(129));
        assert_eq!(
            control_message(r#"{"type":"error","message":"agent gone"}"#),
            Control::Error("agent gone".into())
        );
        assert_eq!(control_message("hello"), Control::Other);
        assert_eq!(ending(Some(3), None, true).unwrap(), 3);
        assert_eq!(ending(None, None, true).unwrap(), 0);
        let lost = ending(None, None, false).unwrap_err();
        assert_eq!(lost.to_string(), "the connection to the server was lost");
        let failed = ending(Some(0), Some("agent gone".into()), true).unwrap_err();
        assert_eq!(failed.to_string(), "the terminal failed: agent gone");
    }

    #[test]
    fn resize_is_cols_then_rows() {
        assert_eq!(resize_message(120, 40), r#"{"resize":[120,40]}"#);
    }
}
