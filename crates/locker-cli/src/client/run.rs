//! `locker run --volume NAME -- CMD…`: a serverless call. A fresh machine with the volume
//! at `--mount-path` runs the command with its output live on the terminal; then the
//! changes it made to the volume are printed on stderr (`+ added`, `~ modified`,
//! `- deleted`, `! conflict`) and `locker run` exits with the command's code, like
//! `locker exec`.

use std::io::{IsTerminal, Read};

use serde_json::{json, Value};

use super::exec::{exit_code_of, note_of, post_streaming};
use super::{base64, parse_kv, print_json, seg, ClientError, Conn};

/// `locker run …`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// The volume (name or vol_… id).
    #[arg(long)]
    pub volume: String,
    /// When the changes are applied: always (default: whatever the exit), on_success (only
    /// after exit 0 and with no conflict) or never.
    #[arg(long, value_parser = ["always", "on_success", "never"])]
    pub commit: Option<String>,
    /// Where the volume appears in the machine (default /workspace; also the default working directory).
    #[arg(long)]
    pub mount_path: Option<String>,
    /// Working directory (default: the mount path).
    #[arg(long)]
    pub cwd: Option<String>,
    /// The machine's template (default: default).
    #[arg(long)]
    pub template: Option<String>,
    /// The machine's runtime: auto (default: the jail), jail or microvm (its own kernel).
    #[arg(long, value_parser = ["auto", "jail", "microvm"])]
    pub runtime: Option<String>,
    /// CPUs of the machine (default 1).
    #[arg(long)]
    pub cpus: Option<f64>,
    /// Memory of the machine in MiB (default 512).
    #[arg(long)]
    pub memory_mb: Option<u64>,
    /// An environment variable of the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// The machine's egress: `none` (default), `all`, `allow:pypi.org,*.github.com,10.0.0.0/8`,
    /// or the policy's JSON (as `sandbox create --network`).
    #[arg(long, value_name = "POLICY", value_parser = super::sandbox::parse_network)]
    pub network: Option<Value>,
    /// Kill the command's whole process tree after this long, in milliseconds. Default
    /// 60000 (one minute); at most 300000 (longer work belongs in a sandbox).
    #[arg(long)]
    pub timeout_ms: Option<u64>,
    /// Run this string with `/bin/sh -c` instead of CMD.
    #[arg(long, value_name = "SCRIPT", conflicts_with = "cmd")]
    pub shell: Option<String>,
    /// Send no standard input, even when it is not a terminal.
    #[arg(long, short = 'n')]
    pub no_stdin: bool,
    /// The program and its arguments (after `--` when they start with `-`).
    #[arg(
        value_name = "CMD",
        trailing_var_arg = true,
        allow_hyphen_values = true,
        required_unless_present = "shell"
    )]
    pub cmd: Vec<String>,
}

/// The request body for these flags.
pub fn run_body(a: &RunArgs, stdin: Option<&[u8]>) -> Value {
    let mut b = json!({});
    match &a.shell {
        Some(s) => b["shell"] = json!(s),
        None => b["cmd"] = json!(a.cmd),
    }
    for (k, v) in [
        ("commit", &a.commit),
        ("mount_path", &a.mount_path),
        ("cwd", &a.cwd),
        ("template", &a.template),
        ("runtime", &a.runtime),
    ] {
        if let Some(v) = v {
            b[k] = json!(v);
        }
    }
    if let Some(t) = a.timeout_ms {
        b["timeout_ms"] = json!(t);
    }
    if let Some(c) = a.cpus {
        b["cpus"] = json!(c);
    }
    if let Some(m) = a.memory_mb {
        b["memory_mb"] = json!(m);
    }
    if let Some(n) = &a.network {
        b["network"] = n.clone();
    }
    if !a.env.is_empty() {
        b["env"] = json!(a
            .env
            .iter()
            .cloned()
            .collect::<std::collections::BTreeMap<_, _>>());
    }
    if let Some(s) = stdin.filter(|s| !s.is_empty()) {
        b["stdin_b64"] = json!(base64(s));
    }
    b
}

/// The change list of a result, one line a path, and when the changes were not applied,
/// a last line saying why (`commit`: the mode asked for; the server's default is always).
pub fn change_lines(result: &Value, commit: Option<&str>) -> Vec<String> {
    let ch = &result["changes"];
    let mut out = Vec::new();
    for (key, mark) in [
        ("added", '+'),
        ("modified", '~'),
        ("deleted", '-'),
        ("conflicts", '!'),
    ] {
        for p in ch[key].as_array().into_iter().flatten() {
            out.push(format!("{mark} {}", p.as_str().unwrap_or_default()));
        }
    }
    match (ch["committed"].as_bool(), ch["commit_error"].as_str()) {
        (_, Some(e)) => out.push(format!("locker: the changes were not committed: {e}")),
        (Some(false), None) if !out.is_empty() => out.push(format!(
            "locker: the changes were not committed: {}",
            why_not_committed(result, commit.unwrap_or("always"))
        )),
        _ => {}
    }
    out
}

/// Why a run's changes were left out, from what the run asked for and how it ended.
fn why_not_committed(result: &Value, commit: &str) -> String {
    let conflicts = result["changes"]["conflicts"]
        .as_array()
        .map_or(0, Vec::len);
    let ended = match (
        result["reason"].as_str(),
        result["exit_code"].as_i64(),
        result["signal"].as_str(),
    ) {
        (Some("exited") | None, Some(0), _) => None,
        (Some("exited") | None, Some(c), _) => Some(format!("the command exited {c}")),
        (Some("timeout"), _, _) => Some("the command ran past its timeout".to_string()),
        (Some("oom"), _, _) => Some("the command ran out of memory".to_string()),
        (_, _, Some(sig)) => Some(format!("the command was ended by {sig}")),
        (Some(r), _, _) => Some(format!("the command ended: {r}")),
        (None, None, None) => None,
    };
    match (commit, ended) {
        ("never", _) => "--commit never keeps a run's changes out of the volume".into(),
        ("on_success", Some(how)) => {
            format!("{how}, and --commit on_success applies them only after exit 0")
        }
        ("on_success", None) if conflicts > 0 => format!(
            "{conflicts} of its paths changed on the volume since this run started, and --commit on_success applies nothing then"
        ),
        _ => "the server gave no reason".into(),
    }
}

/// Runs `locker run …`.
pub fn run(a: RunArgs) -> Result<i32, ClientError> {
    let c = a.conn.client()?;
    let stdin = if a.no_stdin || std::io::stdin().is_terminal() {
        None
    } else {
        let mut buf = Vec::new();
        std::io::stdin()
            .lock()
            .read_to_end(&mut buf)
            .map_err(|e| ClientError::io("cannot read standard input", e))?;
        Some(buf)
    };
    let body = run_body(&a, stdin.as_deref());
    let path = format!("/v1/volumes/{}/run", seg(&a.volume));
    if a.conn.json {
        let v = c.post_json(&path, &body)?;
        print_json(&v)?;
        return Ok(exit_code_of(&v));
    }
    let outcome = {
        let mut out = std::io::stdout().lock();
        let mut err = std::io::stderr().lock();
        post_streaming(&c, &path, &body, &mut out, &mut err)?
    };
    for l in change_lines(&outcome.result, a.commit.as_deref()) {
        eprintln!("{l}");
    }
    if let Some(note) = note_of(&outcome.result) {
        eprintln!("locker: {note}");
    }
    Ok(outcome.code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_print_one_line_a_path() {
        let r = json!({"changes": {"added": ["/a"], "modified": ["/b"], "deleted": ["/c"],
            "conflicts": ["/b"], "committed": true}});
        assert_eq!(change_lines(&r, None), vec!["+ /a", "~ /b", "- /c", "! /b"]);
        let changes = json!({"added": ["/a"], "modified": [], "deleted": [],
            "conflicts": [], "committed": false});
        let r = json!({"reason": "exited", "exit_code": 0, "changes": changes});
        assert_eq!(
            change_lines(&r, Some("never"))[1],
            "locker: the changes were not committed: --commit never keeps a run's changes out of the volume"
        );
        let r = json!({"reason": "exited", "exit_code": 3, "changes": changes});
        assert_eq!(
            change_lines(&r, Some("on_success"))[1],
            "locker: the changes were not committed: the command exited 3, and --commit on_success applies them only after exit 0"
        );
        let r = json!({"reason": "timeout", "exit_code": null, "changes": changes});
        assert!(change_lines(&r, Some("on_success"))[1].contains("ran past its timeout"));
        let mut c = changes.clone();
        c["conflicts"] = json!(["/a"]);
        let r = json!({"reason": "exited", "exit_code": 0, "changes": c});
        assert!(change_lines(&r, Some("on_success"))[2].contains("1 of its paths changed"));
        let mut c = changes.clone();
        c["commit_error"] = json!("the volume is full");
        let r = json!({"reason": "exited", "exit_code": 0, "changes": c});
        assert_eq!(
            change_lines(&r, None)[1],
            "locker: the changes were not committed: the volume is full"
        );
    }
}
