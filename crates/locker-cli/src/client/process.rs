//! `locker exec --background`, `locker ps SB` and `locker process list|get|logs|wait|kill|stdin|attach`:
//! commands that outlive one call, over `/v1/sandboxes/{id}/processes…`.
//!
//! A background process is started like an exec (same flags, same body) and answered at
//! once with its id; its output is kept by the sandbox's agent and replayed from the start
//! by `logs` (which follows it live with `-f`), and `wait` leaves with its exit code as
//! `locker exec` would. Nothing here holds a process alive: it lives in the sandbox, not in
//! this CLI, and ends when it exits, is killed, runs past a `--timeout-ms`, or its sandbox
//! goes. This module must not print anything but what the server sent and the ids it made.

use std::io::{self, BufReader, IsTerminal};

use serde_json::{json, Value};

use super::exec::{exec_request, exit_code_of, feed_stdin, note_of, pump_ndjson, ExecArgs};
use super::records::{command_text, outcome_text};
use super::render::{cell, kv_lines, now_secs, relative, table};
use super::{items, print_json, print_text, seg, Client, ClientError, Conn};

/// `locker process …`.
#[derive(clap::Args, Debug)]
pub struct ProcessArgs {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub cmd: ProcessCmd,
}

/// `locker ps SB`: the same list as `locker process list SB`.
#[derive(clap::Args, Debug)]
pub struct PsArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// The sandbox (sb_…).
    pub sandbox: String,
}

/// The process subcommands. PROCESS is a process id (proc_…) as `locker exec
/// --background` printed it.
#[derive(clap::Subcommand, Debug)]
pub enum ProcessCmd {
    /// List a sandbox's background processes, running and ended (also `locker ps SB`).
    #[command(visible_alias = "ls")]
    List {
        /// The sandbox (sb_…).
        sandbox: String,
    },
    /// Show one process: its command, its state, and how it ended once it has.
    Get {
        /// The sandbox (sb_…).
        sandbox: String,
        /// The process (proc_…).
        process: String,
    },
    /// Print a process's output from its start (stdout to stdout, stderr to stderr); with
    /// -f, keep printing it as it comes until the process ends. With --json, the server's
    /// NDJSON stream as it is.
    Logs {
        /// The sandbox (sb_…).
        sandbox: String,
        /// The process (proc_…).
        process: String,
        /// Follow the output until the process ends (default: print what there is and
        /// leave).
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// Wait until a process ends and leave with its exit code, as `locker exec` does
    /// (124 after a timeout, 128 + N after signal N). Its output is not printed: see `logs`.
    Wait {
        /// The sandbox (sb_…).
        sandbox: String,
        /// The process (proc_…).
        process: String,
    },
    /// Send a process a signal (default SIGTERM); prints its id.
    Kill {
        /// The sandbox (sb_…).
        sandbox: String,
        /// The process (proc_…).
        process: String,
        /// The signal: a name (TERM, SIGKILL, INT, HUP…) or a number.
        #[arg(long, short = 's', default_value = "SIGTERM", value_parser = parse_signal)]
        signal: String,
    },
    /// Write this command's standard input into a process's stdin, as it comes; with
    /// --close the process then sees end of file.
    Stdin {
        /// The sandbox (sb_…).
        sandbox: String,
        /// The process (proc_…).
        process: String,
        /// Close the process's stdin after the input ends (default: leave it open for
        /// more writes).
        #[arg(long)]
        close: bool,
    },
    /// Attach to a process: print its output (from its start, then as it comes) while this
    /// command's standard input streams into its stdin (closed at the end of the input;
    /// `-n`: none sent). Leaves with its exit code when it ends; Ctrl-C leaves it running.
    Attach {
        /// The sandbox (sb_…).
        sandbox: String,
        /// The process (proc_…).
        process: String,
        /// Send no input and leave its stdin open.
        #[arg(long, short = 'n')]
        no_stdin: bool,
    },
}

/// A signal as the API takes it: the canonical `SIGNAME`, or the number.
fn parse_signal(s: &str) -> Result<String, String> {
    let n = super::exec::signal_number(s).ok_or_else(|| {
        format!("unknown signal {s:?}: give a name (TERM, KILL, INT, HUP, USR1…) or a number")
    })?;
    if s.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(n.to_string());
    }
    let upper = s.to_ascii_uppercase();
    Ok(if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    })
}

fn procs_path(sandbox: &str) -> String {
    format!("/v1/sandboxes/{}/processes", seg(sandbox))
}

fn proc_path(sandbox: &str, process: &str) -> String {
    format!("{}/{}", procs_path(sandbox), seg(process))
}

/// `locker exec --background`: starts the command as a process and prints its id. Its
/// standard input stays open for `locker process stdin` (this command reads none).
pub fn start(c: &Client, a: &ExecArgs) -> Result<i32, ClientError> {
    let req = exec_request(a, None);
    req.validate().map_err(ClientError::Usage)?;
    let body = serde_json::to_value(&req)
        .map_err(|e| ClientError::Protocol(format!("cannot encode the request: {e}")))?;
    let v = c.post_json(&procs_path(&a.sandbox), &body)?;
    if a.conn.json {
        print_json(&v)?;
    } else {
        let id = v.get("id").and_then(Value::as_str).ok_or_else(|| {
            ClientError::Protocol("the server did not name the started process".into())
        })?;
        print_text(&format!("{id}\n"))?;
    }
    Ok(0)
}

/// The process list as a table for people.
pub fn list_table(procs: &[Value], now: i64) -> String {
    let rows: Vec<Vec<String>> = procs
        .iter()
        .map(|p| {
            let exit = match p.get("result") {
                Some(r) if r.is_object() => outcome_text(r),
                _ => "-".to_string(),
            };
            let started = p.get("started_at").and_then(Value::as_str).unwrap_or("");
            let argv = json!({ "cmd": p.get("argv").cloned().unwrap_or(Value::Null) });
            vec![
                cell(p.get("id")),
                cell(p.get("pid")),
                cell(p.get("state")),
                exit,
                relative(now, started),
                command_text(&argv),
            ]
        })
        .collect();
    table(&["ID", "PID", "STATE", "EXIT", "STARTED", "COMMAND"], &rows)
}

/// The fields `process get` shows first, in this order.
const GET_ORDER: &[&str] = &["id", "pid", "state", "argv", "started_at", "result"];

fn list(c: &Client, json_out: bool, sandbox: &str) -> Result<i32, ClientError> {
    let v = c.get_json(&procs_path(sandbox), &[])?;
    if json_out {
        print_json(&v)?;
    } else {
        print_text(&list_table(items(&v, "processes")?, now_secs()))?;
    }
    Ok(0)
}

/// Runs `locker ps SB`.
pub fn run_ps(a: PsArgs) -> Result<i32, ClientError> {
    list(&a.conn.client()?, a.conn.json, &a.sandbox)
}

/// Runs `locker process …`.
pub fn run(a: ProcessArgs) -> Result<i32, ClientError> {
    let c = a.conn.client()?;
    let json_out = a.conn.json;
    match a.cmd {
        ProcessCmd::List { sandbox } => list(&c, json_out, &sandbox),
        ProcessCmd::Get { sandbox, process } => {
            let v = c.get_json(&proc_path(&sandbox, &process), &[])?;
            if json_out {
                print_json(&v)?;
            } else {
                let mut shown = v.clone();
                if let Some(argv) = v.get("argv") {
                    shown["argv"] = json!(command_text(&json!({ "cmd": argv })));
                }
                print_text(&kv_lines(&shown, GET_ORDER, now_secs()))?;
            }
            Ok(0)
        }
        ProcessCmd::Logs {
            sandbox,
            process,
            follow,
        } => {
            if json_out {
                // The server's NDJSON lines as they come (chunks, then the result or state).
                let mut r = c.get_stream_accept(
                    &format!("{}/output", proc_path(&sandbox, &process)),
                    &[("follow", follow.to_string())],
                    "application/x-ndjson",
                )?;
                let mut out = io::stdout().lock();
                io::copy(&mut r, &mut out)
                    .map_err(|e| ClientError::io("copying the output stream failed", e))?;
            } else {
                output(&c, &sandbox, &process, follow, false)?;
            }
            Ok(0)
        }
        ProcessCmd::Attach {
            sandbox,
            process,
            no_stdin,
        } => {
            let path = proc_path(&sandbox, &process);
            c.get_json(&path, &[])?;
            if !no_stdin {
                let (c, stdin_path) = (c.clone(), format!("{path}/stdin"));
                std::thread::Builder::new()
                    .name("stdin".into())
                    .spawn(move || {
                        // A failed write ends the feed quietly: the process has ended or
                        // closed its input; the output stream says how it ended.
                        let _ = feed_stdin(&c, &stdin_path, Vec::new(), true);
                    })
                    .map_err(|e| ClientError::io("cannot start the stdin thread", e))?;
            }
            let result = output(&c, &sandbox, &process, true, json_out)?;
            if json_out {
                print_json(&result)?;
            } else if let Some(note) = note_of(&result) {
                eprintln!("locker: {note}");
            }
            Ok(exit_code_of(&result))
        }
        ProcessCmd::Wait { sandbox, process } => {
            let result = output(&c, &sandbox, &process, true, true)?;
            if json_out {
                print_json(&result)?;
            } else if let Some(note) = note_of(&result) {
                eprintln!("locker: {note}");
            }
            Ok(exit_code_of(&result))
        }
        ProcessCmd::Kill {
            sandbox,
            process,
            signal,
        } => {
            let sig = match signal.parse::<u64>() {
                Ok(n) => json!(n),
                Err(_) => json!(signal),
            };
            let v = c.post_json(
                &format!("{}/signal", proc_path(&sandbox, &process)),
                &json!({ "signal": sig }),
            )?;
            if json_out {
                print_json(&v)?;
            } else {
                print_text(&format!("{process}\n"))?;
            }
            Ok(0)
        }
        ProcessCmd::Stdin {
            sandbox,
            process,
            close,
        } => {
            let path = proc_path(&sandbox, &process);
            // Fail on an unknown process before reading any input.
            c.get_json(&path, &[])?;
            if io::stdin().is_terminal() {
                eprintln!(
                    "locker: reading the process's input from this terminal; end it with Ctrl-D"
                );
            }
            feed_stdin(&c, &format!("{path}/stdin"), Vec::new(), close)?;
            if json_out {
                print_json(&json!({ "id": process, "closed": close }))?;
            }
            Ok(0)
        }
    }
}

/// Reads a process's output stream (`follow`: until it ends), writing it to our stdout
/// and stderr unless `quiet`; returns the last line: the ExecResult once the process has
/// ended, else `{"state": "running"}`.
fn output(
    c: &Client,
    sandbox: &str,
    process: &str,
    follow: bool,
    quiet: bool,
) -> Result<Value, ClientError> {
    let reader = c.get_stream_accept(
        &format!("{}/output", proc_path(sandbox, process)),
        &[("follow", follow.to_string())],
        "application/x-ndjson",
    )?;
    if quiet {
        return pump_ndjson(BufReader::new(reader), &mut io::sink(), &mut io::sink());
    }
    let mut out = io::stdout().lock();
    let mut err = io::stderr().lock();
    pump_ndjson(BufReader::new(reader), &mut out, &mut err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_are_named_as_the_api_takes_them() {
        assert_eq!(parse_signal("term").unwrap(), "SIGTERM");
        assert_eq!(parse_signal("SIGKILL").unwrap(), "SIGKILL");
        assert_eq!(parse_signal("9").unwrap(), "9");
        assert!(parse_signal("NOPE").unwrap_err().contains("unknown signal"));
    }

    #[test]
    fn a_process_reads_as_one_row() {
        let now = 1_796_040_000;
        let procs = vec![
            json!({"id": "proc_1", "pid": 12, "argv": ["sleep", "300"], "state": "running",
                   "started_at": "2026-11-30T11:59:00Z", "result": null}),
            json!({"id": "proc_2", "pid": 13, "argv": ["/bin/sh", "-c", "exit 7"],
                   "state": "exited", "started_at": "2026-11-30T11:00:00Z",
                   "result": {"exit_code": 7, "reason": "exited"}}),
        ];
        assert_eq!(
            list_table(&procs, now),
            "ID      PID  STATE    EXIT  STARTED  COMMAND\n\
             proc_1  12   running  -     60s ago  sleep 300\n\
             proc_2  13   exited   7     60m ago  /bin/sh -c \"exit 7\"\n"
        );
    }
}
