//! `locker exec SB -- CMD…`: run one command in a sandbox with its output live on the
//! terminal, and leave with the command's exit code, so that `locker exec` drops into
//! scripts where the command itself would have stood.
//!
//! The output arrives as NDJSON (`Accept: application/x-ndjson`): one `stdout`/`stderr`
//! chunk a line, then the `result` (an ExecResult). Chunks are written and flushed as their
//! line arrives, byte for byte (`data_b64` carries what is not UTF-8 text). Ctrl-C needs no
//! handler: the default SIGINT ends this process, the kernel closes the connection, and the
//! contract says closing the stream kills the command.
//!
//! Standard input: none from a terminal; a small regular file travels in the request; a
//! pipe (or anything else) is streamed into the command while it runs, through a
//! background process (see [`run_streamed`]), which then is killed on Ctrl-C explicitly.
//!
//! Exit codes follow the shell's and coreutils' conventions: the command's own code when it
//! exited, 128 + the signal's number when a signal ended it, 124 on timeout (as
//! `timeout(1)`), 137 (128 + SIGKILL) when it was killed for memory or output or by a
//! caller.

use std::io::{self, BufRead, BufReader, IsTerminal, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};

use locker_types::ExecRequest;
use serde_json::{json, Value};

use super::{base64_decode, parse_kv, print_json, seg, Client, ClientError, Conn};

/// The longest NDJSON line accepted from the server (a chunk of output plus framing).
const MAX_LINE: u64 = 16 * 1024 * 1024;

/// `locker exec …`.
#[derive(clap::Args, Debug)]
pub struct ExecArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// The sandbox to run in (sb_…).
    pub sandbox: String,
    /// Working directory inside the sandbox (absolute; default: the user's home, /root for
    /// root).
    #[arg(long)]
    pub cwd: Option<String>,
    /// An environment variable of the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Kill the command's whole process tree after this long, in milliseconds (exit code
    /// 124). Default 60000 (one minute); at most 3600000. A `--background` process runs
    /// until it ends or its sandbox does, unless this is given.
    #[arg(long)]
    pub timeout_ms: Option<u64>,
    /// Bytes of each output stream kept in the ExecResult (`--json`), head and tail; the
    /// rest is in a file in the sandbox (`output_path`). The terminal gets it all. Default
    /// 65536.
    #[arg(long)]
    pub max_output_bytes: Option<u64>,
    /// The user to run as, a name or a uid (default: root).
    #[arg(long, short = 'u')]
    pub user: Option<String>,
    /// Run this string with `/bin/sh -c` instead of CMD.
    #[arg(long, value_name = "SCRIPT", conflicts_with = "cmd")]
    pub shell: Option<String>,
    /// Send no standard input, even when it is not a terminal (as `ssh -n`).
    #[arg(long, short = 'n', conflicts_with_all = ["interactive", "tty"])]
    pub no_stdin: bool,
    /// Start the command as a background process and print its id (proc_…) at once; it
    /// outlives this call. Follow it with `locker process logs SB PROC -f`, wait for its
    /// exit code with `process wait`, stop it with `process kill`, feed its stdin (open,
    /// and not read from here) with `process stdin`; `locker ps SB` lists them.
    #[arg(long, short = 'd', conflicts_with_all = ["interactive", "tty", "no_stdin"])]
    pub background: bool,
    /// Keep standard input open and stream it to the command, also from a terminal
    /// (line by line, as the terminal sends it). Without it a terminal sends nothing.
    #[arg(long, short = 'i')]
    pub interactive: bool,
    /// Run the command in a terminal of its own (`-it` for an interactive program:
    /// `locker exec -it SB -- python3`): keys go to it raw, the window size follows.
    /// Takes `--cwd` and `--env`; not `--user`, `--timeout-ms` or `--json`.
    #[arg(long, short = 't', conflicts_with_all = ["user", "timeout_ms", "max_output_bytes"])]
    pub tty: bool,
    /// The program and its arguments (after `--` when they start with `-`).
    #[arg(
        value_name = "CMD",
        trailing_var_arg = true,
        allow_hyphen_values = true,
        required_unless_present = "shell"
    )]
    pub cmd: Vec<String>,
}

/// How an exec ended, as the CLI reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecOutcome {
    /// The exit code `locker exec` leaves with (see the module doc).
    pub code: i32,
    /// The ExecResult as the server sent it.
    pub result: Value,
}

/// The request body for these flags, with `stdin` (when there is any) as `stdin_b64`.
pub fn exec_request(a: &ExecArgs, stdin: Option<&[u8]>) -> ExecRequest {
    ExecRequest {
        cmd: if a.shell.is_some() {
            None
        } else {
            Some(a.cmd.clone())
        },
        shell: a.shell.clone(),
        cwd: a.cwd.clone(),
        env: a.env.iter().cloned().collect(),
        stdin: None,
        stdin_b64: stdin.filter(|s| !s.is_empty()).map(super::base64),
        timeout_ms: a.timeout_ms,
        max_output_bytes: a.max_output_bytes,
        user: a.user.clone(),
    }
}

/// Linux's number of a signal given by name (`SIGKILL`, `KILL`) or number (`"9"`).
pub fn signal_number(name: &str) -> Option<i32> {
    if let Ok(n) = name.parse::<i32>() {
        return (1..=64).contains(&n).then_some(n);
    }
    let upper = name.to_ascii_uppercase();
    let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
    const NAMES: [&str; 31] = [
        "HUP", "INT", "QUIT", "ILL", "TRAP", "ABRT", "BUS", "FPE", "KILL", "USR1", "SEGV", "USR2",
        "PIPE", "ALRM", "TERM", "STKFLT", "CHLD", "CONT", "STOP", "TSTP", "TTIN", "TTOU", "URG",
        "XCPU", "XFSZ", "VTALRM", "PROF", "WINCH", "IO", "PWR", "SYS",
    ];
    if bare == "IOT" {
        return Some(6);
    }
    NAMES.iter().position(|n| *n == bare).map(|i| i as i32 + 1)
}

/// The exit code for an ExecResult (see the module doc).
pub fn exit_code_of(result: &Value) -> i32 {
    let reason = result.get("reason").and_then(Value::as_str).unwrap_or("");
    let code = result.get("exit_code").and_then(Value::as_i64);
    let signal = result
        .get("signal")
        .and_then(Value::as_str)
        .and_then(signal_number);
    match (reason, code, signal) {
        ("timeout", _, _) => 124,
        ("exited", Some(c), _) | ("", Some(c), None) if (0..=255).contains(&c) => c as i32,
        ("exited", Some(_), _) | ("", Some(_), None) => 1,
        (_, _, Some(s)) => 128 + s,
        ("oom" | "output_limit" | "killed", _, None) => 137,
        _ => 1,
    }
}

/// A line for people saying why the command ended, when it did not simply exit.
pub fn note_of(result: &Value) -> Option<String> {
    let reason = result.get("reason").and_then(Value::as_str)?;
    let signal = result.get("signal").and_then(Value::as_str);
    let mut note = match reason {
        "exited" => return None,
        "timeout" => "the command ran past its timeout; its process tree was killed".to_string(),
        "oom" => "the command ran out of memory and was killed".to_string(),
        "output_limit" => {
            "the command wrote more output than the machine may keep; it was killed".to_string()
        }
        "killed" => "the command was killed".to_string(),
        "signaled" => format!("the command was ended by {}", signal.unwrap_or("a signal")),
        other => format!("the command ended: {other}"),
    };
    note.push_str(&format!(" (exit code {})", exit_code_of(result)));
    Some(note)
}

/// Runs `req` in sandbox `sandbox`, writing its output to `out` and `err` as it arrives;
/// returns how it ended. A server that ignores the NDJSON `Accept` and answers one
/// ExecResult is handled too (the output is then written at the end).
pub fn exec_stream(
    c: &Client,
    sandbox: &str,
    req: &ExecRequest,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Result<ExecOutcome, ClientError> {
    let body = serde_json::to_value(req)
        .map_err(|e| ClientError::Protocol(format!("cannot encode the request: {e}")))?;
    let path = format!("/v1/sandboxes/{}/exec", seg(sandbox));
    post_streaming(c, &path, &body, out, err)
}

/// POSTs `body` to `path` (an exec or a run) asking for NDJSON, writing the output to
/// `out` and `err` as it arrives; returns how the command ended.
pub fn post_streaming(
    c: &Client,
    path: &str,
    body: &Value,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Result<ExecOutcome, ClientError> {
    let (ctype, reader) = c.post_stream(path, body, "application/x-ndjson")?;
    let result = if ctype.starts_with("application/json") {
        let mut buf = Vec::new();
        reader
            .take(MAX_LINE * 4)
            .read_to_end(&mut buf)
            .map_err(|e| ClientError::Protocol(format!("reading the result failed: {e}")))?;
        let v: Value = serde_json::from_slice(&buf)
            .map_err(|e| ClientError::Protocol(format!("the result is not JSON ({e})")))?;
        for (key, w) in [("stdout", &mut *out as &mut dyn Write), ("stderr", err)] {
            write_chunk(w, &kept_output(&v, key)?)?;
        }
        v
    } else {
        pump_ndjson(BufReader::new(reader), out, err)?
    };
    Ok(ExecOutcome {
        code: exit_code_of(&result),
        result,
    })
}

/// The bytes an ExecResult kept of `key` (`stdout` or `stderr`): `<key>_b64` when the
/// output was not text, else the text.
fn kept_output(result: &Value, key: &str) -> Result<Vec<u8>, ClientError> {
    match result.get(format!("{key}_b64")).and_then(Value::as_str) {
        Some(b) => base64_decode(b).ok_or_else(|| {
            ClientError::Protocol(format!("the result's `{key}_b64` is not base64"))
        }),
        None => Ok(result
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or("")
            .as_bytes()
            .to_vec()),
    }
}

fn write_chunk(w: &mut dyn Write, data: &[u8]) -> Result<(), ClientError> {
    w.write_all(data)
        .and_then(|()| w.flush())
        .map_err(|e| ClientError::io("cannot write the command's output", e))
}

/// Reads an exec's NDJSON stream: writes each `stdout`/`stderr` chunk to `out`/`err` as
/// its line arrives and returns the final `result` object (without its `type`). Chunks
/// carry text in `data`, or raw bytes in `data_b64` where a server sends them. An
/// `{"type":"error","error":{…}}` line becomes the error it describes; unknown types are
/// skipped, so the server can add some.
pub fn pump_ndjson(
    mut r: impl BufRead,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Result<Value, ClientError> {
    let mut line = Vec::new();
    // Bytes streamed so far on stdout and stderr.
    let mut streamed = [0usize; 2];
    loop {
        line.clear();
        let n = (&mut r)
            .take(MAX_LINE)
            .read_until(b'\n', &mut line)
            .map_err(|e| ClientError::io("reading the command's output stream failed", e))?;
        if n == 0 {
            return Err(ClientError::Protocol(
                "the output stream ended before the command's result (the server or the connection failed)"
                    .into(),
            ));
        }
        if line.last() != Some(&b'\n') && n as u64 == MAX_LINE {
            return Err(ClientError::Protocol(format!(
                "a line of the output stream is longer than {MAX_LINE} bytes"
            )));
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let mut msg: Value = serde_json::from_slice(&line).map_err(|e| {
            ClientError::Protocol(format!("a line of the output stream is not JSON ({e})"))
        })?;
        let kind = msg.get("type").and_then(Value::as_str).unwrap_or("");
        match kind {
            "stdout" | "stderr" => {
                let bytes = match msg.get("data_b64").and_then(Value::as_str) {
                    Some(b) => base64_decode(b).ok_or_else(|| {
                        ClientError::Protocol("a chunk's `data_b64` is not base64".into())
                    })?,
                    None => msg
                        .get("data")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .as_bytes()
                        .to_vec(),
                };
                let (w, i): (&mut dyn Write, usize) =
                    if kind == "stdout" { (out, 0) } else { (err, 1) };
                write_chunk(w, &bytes)?;
                streamed[i] += bytes.len();
            }
            // A process's output read without following ends with its state while it runs.
            "state" => {
                if let Some(m) = msg.as_object_mut() {
                    m.remove("type");
                }
                return Ok(msg);
            }
            "result" => {
                if let Some(m) = msg.as_object_mut() {
                    m.remove("type");
                }
                // Output that only the result carries (a command that could not even
                // start says why in its stderr) is shown rather than lost.
                for (key, i) in [("stdout", 0), ("stderr", 1)] {
                    let kept = kept_output(&msg, key)?;
                    if streamed[i] == 0 && !kept.is_empty() {
                        let w: &mut dyn Write = if i == 0 { &mut *out } else { &mut *err };
                        write_chunk(w, &kept)?;
                    }
                }
                return Ok(msg);
            }
            "error" => {
                let e = msg.get("error").cloned().unwrap_or(Value::Null);
                let code = e
                    .get("code")
                    .and_then(Value::as_str)
                    .unwrap_or("internal")
                    .to_string();
                let message = e
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("the exec failed")
                    .to_string();
                return Err(ClientError::Api {
                    status: status_of(&code),
                    code,
                    message,
                    hint: None,
                });
            }
            _ => {}
        }
    }
}

/// The HTTP status the contract pairs with an error code.
pub fn status_of(code: &str) -> u16 {
    match code {
        "bad_request" => 400,
        "unauthorized" => 401,
        "not_found" => 404,
        "conflict" => 409,
        "payload_too_large" => 413,
        "unprocessable" => 422,
        "quota_exceeded" => 429,
        "unavailable" => 503,
        _ => 500,
    }
}

/// Standard input up to this size, when it is a regular file, travels inside the exec's
/// JSON body (one request); anything else (a pipe, a socket, a device, a bigger file) is
/// streamed into the command as it comes (see [`run_streamed`]).
const INLINE_STDIN_MAX: u64 = 512 << 10;
/// How much of a streamed stdin one request carries (the server takes 64 MiB a request).
const STDIN_REQUEST_BYTES: u64 = 32 << 20;

/// How long a pipe may take to show its first bytes (or its end) before `locker exec`
/// streams it instead of sending it in the request: enough for `echo x | locker exec …`.
const PIPE_FIRST_BYTES_MS: i32 = 5;

/// What `locker exec` does with its own standard input.
enum StdinUse {
    None,
    Inline(Vec<u8>),
    /// Streamed into the command, starting with what was already read.
    Streamed(Vec<u8>),
}

/// Decides without blocking: `/dev/null` is no input; a small regular file, or a pipe that
/// ends within [`INLINE_STDIN_MAX`] bytes as soon as it is looked at, travels in the
/// request (one round trip, the common scripted case); anything else (a pipe still being
/// written, a bigger file, a socket) is streamed.
fn stdin_use(no_stdin: bool) -> Result<StdinUse, ClientError> {
    let stdin = std::io::stdin();
    if no_stdin || stdin.is_terminal() {
        return Ok(StdinUse::None);
    }
    let meta = stdin
        .as_fd()
        .try_clone_to_owned()
        .and_then(|fd| std::fs::File::from(fd).metadata())
        .map_err(|e| ClientError::io("cannot inspect standard input", e))?;
    let ft = meta.file_type();
    if ft.is_char_device() && meta.rdev() == libc::makedev(1, 3) {
        return Ok(StdinUse::None); // /dev/null
    }
    if meta.is_file() {
        if meta.len() > INLINE_STDIN_MAX {
            return Ok(StdinUse::Streamed(Vec::new()));
        }
        let mut buf = Vec::new();
        stdin
            .lock()
            .take(INLINE_STDIN_MAX + 1)
            .read_to_end(&mut buf)
            .map_err(|e| ClientError::io("cannot read standard input", e))?;
        return Ok(StdinUse::Inline(buf));
    }
    if !ft.is_fifo() && !ft.is_socket() {
        return Ok(StdinUse::Streamed(Vec::new()));
    }
    // A pipe or socket: take what is there already, waiting briefly for the first bytes.
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    let mut wait = PIPE_FIRST_BYTES_MS;
    while buf.len() as u64 <= INLINE_STDIN_MAX {
        let mut fds = [libc::pollfd {
            fd: 0,
            events: libc::POLLIN,
            revents: 0,
        }];
        let ready = super::tty::poll(&mut fds, wait)
            .map_err(|e| ClientError::io("cannot wait for standard input", e))?;
        if ready == 0 {
            return Ok(StdinUse::Streamed(buf));
        }
        let n = super::tty::read_fd(0, &mut chunk)
            .map_err(|e| ClientError::io("cannot read standard input", e))?;
        if n == 0 {
            return Ok(if buf.is_empty() {
                StdinUse::None
            } else {
                StdinUse::Inline(buf)
            });
        }
        buf.extend_from_slice(&chunk[..n]);
        wait = 0;
    }
    Ok(StdinUse::Streamed(buf))
}

/// Runs `locker exec …`.
pub fn run(a: ExecArgs) -> Result<i32, ClientError> {
    if a.tty && a.conn.json {
        return Err(ClientError::Usage(
            "-t runs the command in a terminal, whose output is not JSON: leave out --json or -t"
                .into(),
        ));
    }
    if a.tty {
        return super::shell::terminal(&a.conn.endpoint, &a.sandbox, Some(&tty_command(&a)));
    }
    let c = a.conn.client()?;
    if a.background {
        return super::process::start(&c, &a);
    }
    if a.interactive && std::io::stdin().is_terminal() {
        return run_streamed(&c, &a, Vec::new());
    }
    let stdin = match stdin_use(a.no_stdin)? {
        StdinUse::Streamed(prefix) => return run_streamed(&c, &a, prefix),
        StdinUse::Inline(b) => Some(b),
        StdinUse::None => None,
    };
    let req = exec_request(&a, stdin.as_deref());
    req.validate().map_err(ClientError::Usage)?;
    if a.conn.json {
        let body = serde_json::to_value(&req)
            .map_err(|e| ClientError::Protocol(format!("cannot encode the request: {e}")))?;
        let v = c.post_json(&format!("/v1/sandboxes/{}/exec", seg(&a.sandbox)), &body)?;
        print_json(&v)?;
        return Ok(exit_code_of(&v));
    }
    let outcome = {
        let mut out = std::io::stdout().lock();
        let mut err = std::io::stderr().lock();
        exec_stream(&c, &a.sandbox, &req, &mut out, &mut err)?
    };
    if let Some(note) = note_of(&outcome.result) {
        eprintln!("locker: {note}");
    }
    Ok(outcome.code)
}

/// The `/bin/sh` command line `locker exec -t` runs in its terminal: the working
/// directory, the environment, then the command itself (`exec`, so its exit code is the
/// terminal's).
fn tty_command(a: &ExecArgs) -> String {
    use super::shell::shell_words;
    let mut line = String::new();
    if let Some(cwd) = &a.cwd {
        line.push_str(&format!(
            "cd {} && ",
            shell_words(std::slice::from_ref(cwd))
        ));
    }
    line.push_str("exec ");
    if !a.env.is_empty() {
        let kv: Vec<String> = a.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        line.push_str(&format!("env {} ", shell_words(&kv)));
    }
    match &a.shell {
        Some(script) => line.push_str(&format!(
            "/bin/sh -c {}",
            shell_words(std::slice::from_ref(script))
        )),
        None => line.push_str(&shell_words(&a.cmd)),
    }
    line
}

/// `locker exec` with a piped standard input: the command starts at once as a process
/// whose stdin is fed from ours as it comes (`yes | locker exec SB -- head -1` ends when
/// `head` does; gigabytes pass through without being held), while its output is followed
/// live. The command lives on the server beyond this connection, so an interrupt
/// (Ctrl-C, SIGTERM, SIGHUP) kills it before this process leaves, as closing an exec's
/// stream would.
fn run_streamed(c: &Client, a: &ExecArgs, prefix: Vec<u8>) -> Result<i32, ClientError> {
    let req = exec_request(a, None);
    req.validate().map_err(ClientError::Usage)?;
    let body = serde_json::to_value(&req)
        .map_err(|e| ClientError::Protocol(format!("cannot encode the request: {e}")))?;
    let started: Arc<Mutex<Option<String>>> = Arc::default();
    // The signal that interrupted us (0: none). Set before the kill is asked for, so the
    // killed command's result arriving first cannot make us leave with its code.
    let interrupted = Arc::new(AtomicI32::new(0));
    {
        let (c, started, interrupted) = (c.clone(), started.clone(), interrupted.clone());
        super::tty::on_interrupt(move |sig| {
            interrupted.store(sig, Ordering::SeqCst);
            let path = started.lock().ok().and_then(|p| p.clone());
            if let Some(p) = path {
                let _ = c.post_json(&format!("{p}/signal"), &json!({"signal": "SIGKILL"}));
            }
            std::process::exit(128 + sig);
        })
        .map_err(|e| ClientError::io("cannot take over interrupts", e))?;
    }
    let sandbox = seg(&a.sandbox);
    let v = c.post_json(&format!("/v1/sandboxes/{sandbox}/processes"), &body)?;
    let id = v.get("id").and_then(Value::as_str).ok_or_else(|| {
        ClientError::Protocol("the server did not name the started process".into())
    })?;
    let path = format!("/v1/sandboxes/{sandbox}/processes/{}", seg(id));
    if let Ok(mut p) = started.lock() {
        *p = Some(path.clone());
    }
    {
        let (c, stdin_path) = (c.clone(), format!("{path}/stdin"));
        std::thread::Builder::new()
            .name("stdin".into())
            .spawn(move || {
                // A failed write ends the feed quietly: the command has ended (it stopped
                // reading), or the output stream reports what went wrong.
                let _ = feed_stdin(&c, &stdin_path, prefix, true);
            })
            .map_err(|e| ClientError::io("cannot start the stdin thread", e))?;
    }
    let reader = c.get_stream_accept(
        &format!("{path}/output"),
        &[("follow", "true".to_string())],
        "application/x-ndjson",
    )?;
    let result = if a.conn.json {
        let v = pump_ndjson(BufReader::new(reader), &mut io::sink(), &mut io::sink())?;
        print_json(&v)?;
        v
    } else {
        let mut out = io::stdout().lock();
        let mut err = io::stderr().lock();
        pump_ndjson(BufReader::new(reader), &mut out, &mut err)?
    };
    let sig = interrupted.load(Ordering::SeqCst);
    if sig != 0 {
        return Ok(128 + sig);
    }
    if !a.conn.json {
        if let Some(note) = note_of(&result) {
            eprintln!("locker: {note}");
        }
    }
    Ok(exit_code_of(&result))
}

/// Streams our standard input into a process's stdin: each request carries up to
/// [`STDIN_REQUEST_BYTES`], sent as it is read, starting with `prefix` (what was read
/// already); at end of file the process's stdin is closed when `close` says so.
pub fn feed_stdin(c: &Client, path: &str, prefix: Vec<u8>, close: bool) -> Result<(), ClientError> {
    if !prefix.is_empty() {
        c.post_body(path, &[], &prefix[..])?;
    }
    let mut stdin = io::stdin().lock();
    loop {
        let mut part = Counted {
            inner: (&mut stdin).take(STDIN_REQUEST_BYTES),
            n: 0,
        };
        c.post_body(path, &[], ureq::SendBody::from_reader(&mut part))?;
        if part.n < STDIN_REQUEST_BYTES {
            break;
        }
    }
    if close {
        c.post_body(path, &[("close", "true".to_string())], &[][..])?;
    }
    Ok(())
}

/// A reader that counts what passed through it.
struct Counted<R> {
    inner: R,
    n: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(cmd: &[&str]) -> ExecArgs {
        ExecArgs {
            conn: super::super::Conn::default(),
            sandbox: "sb_1".into(),
            cwd: None,
            env: vec![],
            timeout_ms: None,
            max_output_bytes: None,
            user: None,
            shell: None,
            no_stdin: false,
            interactive: false,
            tty: false,
            background: false,
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn request_body_maps_flags_and_stdin() {
        let mut a = args(&["python3", "-c", "print(1)"]);
        a.cwd = Some("/root".into());
        a.env = vec![("K".into(), "V".into())];
        a.timeout_ms = Some(5000);
        let body = serde_json::to_value(exec_request(&a, Some(b"hi\n"))).unwrap();
        assert_eq!(
            body,
            json!({"cmd": ["python3", "-c", "print(1)"], "cwd": "/root", "env": {"K": "V"},
                   "stdin_b64": "aGkK", "timeout_ms": 5000})
        );
        let mut a = args(&[]);
        a.shell = Some("cd app && npm test".into());
        let body = serde_json::to_value(exec_request(&a, Some(b""))).unwrap();
        assert_eq!(body, json!({"shell": "cd app && npm test"}));
    }

    #[test]
    fn exit_codes_follow_shell_conventions() {
        let r = |v: Value| exit_code_of(&v);
        assert_eq!(r(json!({"reason": "exited", "exit_code": 0})), 0);
        assert_eq!(r(json!({"reason": "exited", "exit_code": 3})), 3);
        assert_eq!(r(json!({"reason": "exited", "exit_code": 300})), 1);
        assert_eq!(
            r(json!({"reason": "signaled", "exit_code": null, "signal": "SIGSEGV"})),
            139
        );
        assert_eq!(r(json!({"reason": "signaled", "signal": "TERM"})), 143);
        assert_eq!(r(json!({"reason": "timeout", "signal": "SIGKILL"})), 124);
        assert_eq!(r(json!({"reason": "oom", "exit_code": null})), 137);
        assert_eq!(r(json!({"reason": "killed", "signal": "SIGTERM"})), 143);
        assert_eq!(r(json!({"reason": "output_limit"})), 137);
        assert_eq!(r(json!({})), 1);
    }

    #[test]
    fn signal_names_and_numbers() {
        assert_eq!(signal_number("SIGKILL"), Some(9));
        assert_eq!(signal_number("sigint"), Some(2));
        assert_eq!(signal_number("SYS"), Some(31));
        assert_eq!(signal_number("15"), Some(15));
        assert_eq!(signal_number("SIGNOPE"), None);
        assert_eq!(signal_number("0"), None);
    }

    #[test]
    fn notes_only_when_the_command_did_not_just_exit() {
        assert_eq!(note_of(&json!({"reason": "exited", "exit_code": 1})), None);
        assert_eq!(
            note_of(&json!({"reason": "timeout"})).unwrap(),
            "the command ran past its timeout; its process tree was killed (exit code 124)"
        );
        assert_eq!(
            note_of(&json!({"reason": "signaled", "signal": "SIGSEGV"})).unwrap(),
            "the command was ended by SIGSEGV (exit code 139)"
        );
    }

    #[test]
    fn ndjson_chunks_go_to_their_stream_in_order() {
        let stream = concat!(
            "{\"type\":\"stdout\",\"data\":\"hello \"}\n",
            "\n",
            "{\"type\":\"stderr\",\"data\":\"warn\\n\"}\n",
            "{\"type\":\"progress\",\"pct\":50}\n",
            "{\"type\":\"stdout\",\"data_b64\":\"/wA=\"}\n",
            "{\"type\":\"result\",\"call_id\":\"call_1\",\"exit_code\":2,\"reason\":\"exited\"}\n",
            "{\"type\":\"stdout\",\"data\":\"after the result: ignored\"}\n",
        );
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let result = pump_ndjson(stream.as_bytes(), &mut out, &mut err).unwrap();
        assert_eq!(out, b"hello \xff\x00");
        assert_eq!(err, b"warn\n");
        assert_eq!(
            result,
            json!({"call_id": "call_1", "exit_code": 2, "reason": "exited"})
        );
        assert_eq!(exit_code_of(&result), 2);
    }

    #[test]
    fn output_only_the_result_carries_is_shown_once() {
        let stream = concat!(
            "{\"type\":\"stdout\",\"data\":\"a\\n\"}\n",
            "{\"type\":\"result\",\"exit_code\":127,\"reason\":\"exited\",",
            "\"stdout\":\"a\\n\",\"stderr\":\"cannot run x\\n\"}\n",
        );
        let (mut out, mut err) = (Vec::new(), Vec::new());
        pump_ndjson(stream.as_bytes(), &mut out, &mut err).unwrap();
        assert_eq!(out, b"a\n");
        assert_eq!(err, b"cannot run x\n");
    }

    #[test]
    fn a_result_without_a_final_newline_still_counts() {
        let stream = "{\"type\":\"result\",\"exit_code\":0,\"reason\":\"exited\"}";
        let result = pump_ndjson(stream.as_bytes(), &mut Vec::new(), &mut Vec::new()).unwrap();
        assert_eq!(exit_code_of(&result), 0);
    }

    #[test]
    fn a_stream_cut_before_the_result_is_an_error() {
        let stream = "{\"type\":\"stdout\",\"data\":\"partial\"}\n";
        let mut out = Vec::new();
        let e = pump_ndjson(stream.as_bytes(), &mut out, &mut Vec::new()).unwrap_err();
        assert_eq!(out, b"partial");
        assert!(
            e.to_string().contains("ended before the command's result"),
            "{e}"
        );
        let e = pump_ndjson("not json\n".as_bytes(), &mut out, &mut Vec::new()).unwrap_err();
        assert!(e.to_string().contains("not JSON"), "{e}");
    }

    #[test]
    fn an_error_line_becomes_the_contract_error() {
        let stream = r#"{"type":"error","error":{"code":"not_found","message":"sandbox sb_1 does not exist"}}"#;
        let e = pump_ndjson(stream.as_bytes(), &mut Vec::new(), &mut Vec::new()).unwrap_err();
        assert_eq!(e.to_string(), "sandbox sb_1 does not exist (404 not_found)");
    }

    #[test]
    fn a_closed_stdout_stops_quietly() {
        struct Closed;
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let stream = "{\"type\":\"stdout\",\"data\":\"x\"}\n";
        let e = pump_ndjson(stream.as_bytes(), &mut Closed, &mut Vec::new()).unwrap_err();
        assert_eq!(e.exit_code(), 141);
        assert!(super::super::render::error_line(&e).is_none());
    }
}
