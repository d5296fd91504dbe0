//! Running a command: from an `ExecSpec` to an `ExecResult`.
//!
//! A command gets its own session (so its own process group), its own cgroup, pipes (or a
//! pseudo-terminal) for its standard streams, and a supervisor that waits for the first of:
//! its exit (from the reaper), its timeout, a cancel from the host, or too much output. Any of
//! the last three kills its whole tree. An exec ends when its command's own process exits:
//! what it left running (`cmd &`, daemons) keeps running as a job (see `jobs`), and the exec
//! does not wait for it to close the output pipes; unless the spec says `kill_jobs` (a
//! serverless run, whose machine ends with the command) or the caller signalled the process
//! (a background process being killed), and then the whole tree dies with the command.
//!
//! Threads per command: the supervisor (the stream's own thread), one output pump (all output
//! fds through `poll`), and for `Exec` with stdin or a terminal one input pump.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use locker_proto::{
    AgentError, Chan, Control, EndBody, ErrorCode, ExecSpec, PtySize, Reply, MAX_PAYLOAD,
};
use locker_types::{ExecResult, Reason, Timings, Usage};

use crate::capture::{Capture, Pushed};
use crate::cgroup::CmdCgroup;
use crate::conn::{Inbound, Recv, Stream};
use crate::jobs::Drain;
use crate::reaper::ExitInfo;
use crate::users::{self, User};
use crate::{sys, Agent};

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// After the command ended, an output pipe that stays open this long without data is given up
/// (something outside the command's tree holds it).
const QUIET_GRACE: Duration = Duration::from_secs(2);
/// After the command ended without cgroups (so its tree's death is not certain), the pump
/// stops after this long even if data keeps coming from a process that escaped.
const HARD_GRACE: Duration = Duration::from_secs(10);

/// After a command that left jobs ended: how long its output already in the pipes may take
/// to drain (it is there when the process exits; jobs writing on keep it from going quiet).
const JOBS_DRAIN: Duration = Duration::from_millis(100);

/// When the output pump may stop before every pipe is closed.
#[derive(Debug, Clone, Copy)]
struct StopRule {
    /// Stop as soon as no pipe has data after this.
    quiet_after: Instant,
    /// Stop now even if data keeps coming.
    hard: Option<Instant>,
    /// Jobs still hold the pipes: hand them to the jobs' drain instead of closing them.
    hand_over: bool,
}

type StopAt = Arc<Mutex<Option<StopRule>>>;

/// What wakes a command's supervisor.
#[derive(Debug)]
pub enum Event {
    Exited(ExitInfo),
    /// The host cancelled the stream (or the connection is gone).
    Cancel,
    /// A stream passed the spill limit.
    OutputLimit,
    /// A caller sent the command a signal (background processes).
    CallerSignal,
}

/// A spec checked against the machine: ready to spawn.
pub struct Prepared {
    pub argv: Vec<String>,
    env: Vec<(String, String)>,
    cwd: String,
    user: User,
}

fn bad(msg: impl Into<String>) -> AgentError {
    AgentError::new(ErrorCode::BadRequest, msg)
}

/// Checks a call id (it names files): letters, digits, `_`, `-`, `.`, not starting with `.`.
pub fn check_id(id: &str) -> Result<(), AgentError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(bad(format!(
            "call id {id:?} must be 1-128 letters, digits, '_', '-' or '.'"
        )))
    }
}

/// Resolves the user, the environment and the working directory of a spec.
pub fn prepare(spec: &ExecSpec) -> Result<Prepared, AgentError> {
    if spec.argv.is_empty() || spec.argv[0].is_empty() {
        return Err(bad("argv must hold at least the program to run"));
    }
    if spec.argv.iter().any(|a| a.contains('\0')) {
        return Err(bad("argv must not contain NUL bytes"));
    }
    let user = users::resolve(spec.user.as_deref()).map_err(bad)?;
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), user.home.clone()),
        ("USER".into(), user.name.clone()),
        ("LANG".into(), "C.UTF-8".into()),
    ];
    if spec.pty.is_some() {
        env.push(("TERM".into(), "xterm-256color".into()));
    }
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(bad(format!(
                "env key {k:?} must be non-empty, without '=' or NUL, and its value without NUL"
            )));
        }
        match env.iter_mut().find(|(ek, _)| ek == k) {
            Some(slot) => slot.1 = v.clone(),
            None => env.push((k.clone(), v.clone())),
        }
    }
    let cwd = match &spec.cwd {
        Some(c) => {
            if !c.starts_with('/') || c.contains('\0') {
                return Err(bad(format!("cwd must be an absolute path, got {c:?}")));
            }
            match std::fs::metadata(c) {
                Ok(m) if m.is_dir() => c.clone(),
                Ok(_) => return Err(bad(format!("cwd {c} is not a directory"))),
                Err(_) => return Err(bad(format!("cwd {c} does not exist in the machine"))),
            }
        }
        None if Path::new(&user.home).is_dir() => user.home.clone(),
        None => "/".into(),
    };
    Ok(Prepared {
        argv: spec.argv.clone(),
        env,
        cwd,
        user,
    })
}

/// Where a command's standard input comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StdinMode {
    Null,
    Pipe,
}

/// Options of one run that differ between `Exec` and `Spawn`.
pub struct RunOptions {
    /// Names the spill (or spool) files: `<output dir>/<name>.stdout|.stderr`.
    pub name: String,
    pub max_output_bytes: u64,
    /// Background processes keep all output in spool files from the start.
    pub spool: bool,
    /// Stream output as `Data` on this stream (respecting credit).
    pub stream: Option<Arc<Stream>>,
    /// Called after each chunk with (0 stdout / 1 stderr, bytes in its file so far).
    pub progress: Option<Arc<dyn Fn(usize, u64) + Send + Sync>>,
    /// Gets `Msg(Started)` once the process exists, before any of its output.
    pub announce: Option<Arc<Stream>>,
    /// Whether what the command leaves running dies with it (`ExecSpec::kill_jobs`).
    pub kill_jobs: bool,
}

/// A command that has started.
pub struct Running {
    pub pid: i32,
    pub started: Instant,
    pub start_ms: f64,
    pub cgroup: Option<Arc<CmdCgroup>>,
    /// The write end of its stdin (pipe mode) or a handle on the terminal's master side.
    pub stdin: Option<File>,
    pub pty_master: Option<File>,
    pub events_tx: Sender<Event>,
    events_rx: Receiver<Event>,
    pump: Option<JoinHandle<[Capture; 2]>>,
    stop: StopAt,
    /// Wakes the output pump when its stop rule changes.
    wake: UnixStream,
    kill_jobs: bool,
    oom_before: (u64, u64),
    call_id: String,
    cap: u64,
    /// Keeps the machine's memory view fresh while the command runs.
    _busy: Option<crate::view::Busy>,
}

/// Why a command could not start.
pub enum StartError {
    /// The request was wrong or the machine is out of something.
    Agent(AgentError),
    /// `exec` itself failed (no such program, not executable): reported as exit 127/126.
    Exec(io::Error),
}

fn spawn_thread<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<JoinHandle<T>> {
    std::thread::Builder::new()
        .name(name.into())
        .stack_size(256 * 1024)
        .spawn(f)
}

/// Spawns the command and its output pump.
pub fn start(
    agent: &Agent,
    prep: &Prepared,
    stdin: StdinMode,
    pty: Option<PtySize>,
    opts: RunOptions,
    opened: Instant,
    call_id: &str,
) -> Result<Running, StartError> {
    let internal = |what: &str, e: io::Error| {
        let code = if matches!(
            e.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::EAGAIN | libc::ENOMEM)
        ) {
            ErrorCode::Busy
        } else {
            ErrorCode::Internal
        };
        StartError::Agent(AgentError::new(code, format!("{what}: {e}")))
    };
    // Before the fork: the view is rewritten while the command starts (unless it just was),
    // so what it reads of its machine's memory is fresh.
    let busy = agent.view.as_ref().map(crate::view::Busy::new);
    agent.jobs.reap();
    let cgroup = agent.cgroups.create();
    let oom_before = (
        cgroup.as_ref().map(|c| c.oom_kills()).unwrap_or(0),
        agent.cgroups.parent_oom_kills(),
    );
    // Drop privileges only when the command runs as someone else than the agent.
    let switch = prep.user.uid != sys::geteuid();
    let plan = sys::ChildPlan {
        cgroup_procs: cgroup.as_ref().map(|c| c.procs_fds()).unwrap_or_default(),
        controlling_tty: pty.is_some(),
        user: switch.then(|| (prep.user.uid, prep.user.gid, prep.user.groups.clone())),
        cwd: std::ffi::CString::new(prep.cwd.clone())
            .map_err(|_| StartError::Agent(bad("cwd contains NUL")))?,
        reset_oom: agent.reset_oom,
        cpus: agent.cpus,
    };
    let mut master: Option<OwnedFd> = None;
    let stdio = match pty {
        Some(size) => {
            let (m, s) = sys::openpty(size.cols, size.rows).map_err(|e| internal("openpty", e))?;
            master = Some(m);
            sys::ChildStdio::Tty(s)
        }
        None => sys::ChildStdio::Pipes {
            stdin: stdin == StdinMode::Pipe,
        },
    };
    let clone_into = cgroup.as_ref().and_then(|c| c.clone_target());
    let (tx, rx) = mpsc::channel();
    let exit_tx = tx.clone();
    // The command starts when it is forked: a command that ends at once may be reaped
    // before `spawn` returns, and its run must not come out as 0 ms.
    let started = Instant::now();
    let spawned = agent.reaper.spawn(
        || {
            let child = sys::spawn(&prep.argv, &prep.env, stdio, &plan, clone_into)?;
            Ok((child.pid, child))
        },
        move |info| {
            let _ = exit_tx.send(Event::Exited(info));
        },
    );
    // The cgroup's join descriptors must not stay open here.
    let mut cgroup = cgroup;
    if let Some(c) = &mut cgroup {
        c.joined();
    }
    let (pid, mut child) = match spawned {
        Ok(x) => x,
        Err(e) => {
            if let Some(c) = cgroup {
                c.release();
            }
            return Err(StartError::Exec(e));
        }
    };
    let start_ms = started.duration_since(opened).as_secs_f64() * 1000.0;
    let spill = |ext: &str| Some(output_file(agent, &opts.name, ext));
    let caps = [
        Capture::new(
            opts.max_output_bytes,
            spill("stdout"),
            opts.spool,
            agent.max_spill_bytes,
        ),
        Capture::new(
            opts.max_output_bytes,
            spill("stderr"),
            opts.spool,
            agent.max_spill_bytes,
        ),
    ];
    let mut sources: Vec<(Chan, usize, OwnedFd)> = Vec::new();
    let mut stdin_file = None;
    let mut pty_master = None;
    if let Some(m) = master {
        match m.try_clone() {
            Ok(w) => pty_master = Some(File::from(w)),
            Err(e) => eprintln!("locker-agent: cannot dup a terminal: {e}"),
        }
        sources.push((Chan::Bytes, 0, m));
    } else {
        if let Some(out) = child.stdout.take() {
            sources.push((Chan::Stdout, 0, out));
        }
        if let Some(err) = child.stderr.take() {
            sources.push((Chan::Stderr, 1, err));
        }
        stdin_file = child.stdin.take().map(File::from);
    }
    drop(child);
    if let Some(s) = &opts.announce {
        let _ = s.msg(Reply::Started { pid, start_ms });
    }
    let stop = Arc::new(Mutex::new(None));
    let pump_stop = stop.clone();
    let pump_tx = tx.clone();
    let (wake, pump_wake) = UnixStream::pair().map_err(|e| internal("socketpair", e))?;
    let drain = agent.jobs.drain();
    let pump = spawn_thread("output", move || {
        pump_output(
            sources,
            caps,
            opts.stream,
            pump_tx,
            (pump_stop, pump_wake, drain),
            opts.progress,
        )
    });
    let cgroup = cgroup.map(Arc::new);
    let running = Running {
        pid,
        started,
        start_ms,
        cgroup,
        stdin: stdin_file,
        pty_master,
        events_tx: tx,
        events_rx: rx,
        pump: None,
        stop,
        wake,
        kill_jobs: opts.kill_jobs,
        oom_before,
        call_id: call_id.to_string(),
        cap: opts.max_output_bytes,
        _busy: busy,
    };
    match pump {
        Ok(h) => Ok(Running {
            pump: Some(h),
            ..running
        }),
        Err(e) => {
            kill_tree(running.pid, running.cgroup.as_deref());
            Err(internal("cannot start the output thread", e))
        }
    }
}

/// Reads every output fd until all are closed (or the drain grace after a kill has passed),
/// capturing and, when asked, streaming what comes.
fn pump_output(
    mut sources: Vec<(Chan, usize, OwnedFd)>,
    mut caps: [Capture; 2],
    mut stream: Option<Arc<Stream>>,
    events: Sender<Event>,
    (stop, mut wake, drain): (StopAt, UnixStream, Arc<Drain>),
    progress: Option<Arc<dyn Fn(usize, u64) + Send + Sync>>,
) -> [Capture; 2] {
    let mut buf = vec![0u8; 64 * 1024];
    let mut over = false;
    let mut hand_over = false;
    while !sources.is_empty() {
        let rule = *stop.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        // Poll no longer than until the rule may stop the pump (the wake fd cuts it short
        // when the rule changes).
        let timeout = rule.map_or(100, |r| {
            r.quiet_after
                .saturating_duration_since(now)
                .as_millis()
                .min(100) as i32
        });
        let mut fds: Vec<RawFd> = sources.iter().map(|s| s.2.as_raw_fd()).collect();
        fds.push(wake.as_raw_fd());
        let Ok(revents) = sys::poll(&fds, timeout) else {
            break;
        };
        let (revents, woken) = revents.split_at(sources.len());
        if woken.first().is_some_and(|r| *r != 0) {
            let _ = wake.read(&mut buf);
            continue;
        }
        // Never give up on a pipe that still has data while the tree is known to be dead:
        // a slow stream consumer must not lose the tail of the output.
        let quiet = revents.iter().all(|r| *r == 0);
        if let Some(r) = rule {
            let now = Instant::now();
            if (quiet && now >= r.quiet_after) || r.hard.is_some_and(|h| now >= h) {
                hand_over = r.hand_over;
                break;
            }
        }
        let mut done = Vec::new();
        for (i, re) in revents.iter().enumerate() {
            if *re == 0 {
                continue;
            }
            let (chan, idx, _) = &sources[i];
            match sys::read(fds[i], &mut buf) {
                // EOF, or EIO from a terminal whose other side is all closed.
                Ok(0) | Err(_) => done.push(i),
                Ok(n) => {
                    let chunk = &buf[..n];
                    if caps[*idx].push(chunk) == Pushed::OverLimit && !over {
                        over = true;
                        let _ = events.send(Event::OutputLimit);
                    }
                    if let Some(p) = &progress {
                        p(*idx, caps[*idx].spilled());
                    }
                    if let Some(s) = &stream {
                        if s.data(*chan, chunk).is_err() {
                            stream = None;
                        }
                    }
                }
            }
        }
        for i in done.into_iter().rev() {
            sources.remove(i);
        }
    }
    if hand_over {
        drain.adopt(sources.into_iter().map(|s| s.2).collect());
    }
    for c in caps.iter_mut() {
        c.finish();
    }
    caps
}

/// Feeds the host's `Data` on `chan` into `sink` (a pipe or a terminal) until `Eof` or the
/// stream ends, returning credit as it goes; terminal resizes are applied to `tty`.
pub fn pump_input(stream: &Stream, chan: Chan, sink: File, tty: Option<RawFd>) {
    let mut sink = Some(sink);
    loop {
        match stream.recv(None) {
            Recv::Item(Inbound::Data(c, bytes)) => {
                if c == chan {
                    if let Some(f) = &mut sink {
                        if f.write_all(&bytes).is_err() {
                            // The command closed its input: drop the rest quietly.
                            sink = None;
                        }
                    }
                }
                stream.credit(c, bytes.len());
            }
            Recv::Item(Inbound::Eof(c)) if c == chan && tty.is_none() => return,
            Recv::Item(Inbound::Control(Control::Resize(size))) => {
                if let Some(fd) = tty {
                    let _ = sys::set_winsize(fd, size.cols, size.rows);
                }
            }
            Recv::Item(_) | Recv::Timeout => {}
            Recv::Gone => return,
        }
    }
}

/// Kills a command's whole tree: its process group at once, then everything in its cgroup.
pub fn kill_tree(pid: i32, cgroup: Option<&CmdCgroup>) {
    let _ = sys::kill(-pid, libc::SIGKILL);
    if let Some(c) = cgroup {
        c.kill_all();
    }
}

/// How the supervision ended.
struct Outcome {
    exit: ExitInfo,
    cause: Option<Reason>,
    caller_signaled: bool,
}

/// Waits for the command to end, killing its tree on timeout, cancel or too much output; then
/// cleans up and builds the result. `reserve` is room the result's frame must leave for
/// whatever is sent with it.
pub fn wait(
    agent: &Agent,
    mut run: Running,
    timeout: Option<Duration>,
    reserve: usize,
) -> ExecResult {
    let deadline = timeout.map(|t| run.started + t);
    let mut cause: Option<Reason> = None;
    let mut caller_signaled = false;
    let exit = loop {
        let ev = match deadline {
            Some(d) if cause.is_none() => {
                match run
                    .events_rx
                    .recv_timeout(d.saturating_duration_since(Instant::now()))
                {
                    Ok(ev) => ev,
                    Err(RecvTimeoutError::Timeout) => {
                        cause = Some(Reason::Timeout);
                        kill_tree(run.pid, run.cgroup.as_deref());
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => unreachable_exit(),
                }
            }
            _ => match run.events_rx.recv() {
                Ok(ev) => ev,
                Err(_) => unreachable_exit(),
            },
        };
        match ev {
            Event::Exited(info) => break info,
            Event::Cancel => {
                cause.get_or_insert(Reason::Killed);
                kill_tree(run.pid, run.cgroup.as_deref());
            }
            Event::OutputLimit => {
                cause.get_or_insert(Reason::OutputLimit);
                kill_tree(run.pid, run.cgroup.as_deref());
            }
            Event::CallerSignal => caller_signaled = true,
        }
    };
    // What the command left running outlives it as a job, unless the command was killed,
    // its caller signalled it (killing a background process kills its tree), or the spec
    // says its tree ends with it. Without cgroups, jobs cannot be told apart: kept.
    // One read of the cgroup tells both: whether jobs were left, and (when none were)
    // that there is no tree left to kill.
    let emptied = match &run.cgroup {
        Some(c) if !run.kill_jobs && cause.is_none() && !caller_signaled => {
            Some(c.pids().is_empty())
        }
        _ => None,
    };
    let keep = !run.kill_jobs && cause.is_none() && !caller_signaled && emptied != Some(true);
    let now = Instant::now();
    let rule = if keep {
        StopRule {
            quiet_after: now,
            hard: Some(now + JOBS_DRAIN),
            hand_over: true,
        }
    } else {
        // The command is over: nothing it started may outlive it.
        let tree_gone = match &run.cgroup {
            Some(_) if emptied == Some(true) => true,
            Some(c) => c.kill_all(),
            None => {
                let _ = sys::kill(-run.pid, libc::SIGKILL);
                false
            }
        };
        StopRule {
            quiet_after: now + QUIET_GRACE,
            hard: (!tree_gone).then(|| now + HARD_GRACE),
            hand_over: false,
        }
    };
    *run.stop.lock().unwrap_or_else(|e| e.into_inner()) = Some(rule);
    // A full socket buffer already holds a wake-up.
    let _ = (&run.wake).write(&[1]);
    run.stdin = None;
    run.pty_master = None;
    let caps = run.pump.take().and_then(|h| h.join().ok());
    let caps = caps.unwrap_or_else(|| {
        [
            Capture::new(1, None, false, 0),
            Capture::new(1, None, false, 0),
        ]
    });
    let measured = run.cgroup.as_ref().map(|c| c.usage()).unwrap_or_default();
    // What the cgroup files do not tell, the child's own rusage approximates.
    let usage = Usage {
        cpu_ms: measured.cpu_ms.unwrap_or(exit.cpu_ms),
        peak_memory_bytes: measured.peak_memory_bytes.unwrap_or(exit.max_rss_bytes),
    };
    let own_oom = run.cgroup.as_ref().map(|c| c.oom_kills()).unwrap_or(0);
    let oom_grew =
        own_oom > run.oom_before.0 || agent.cgroups.parent_oom_kills() > run.oom_before.1;
    let outcome = Outcome {
        exit,
        cause,
        caller_signaled,
    };
    let result = build_result(&run, outcome, caps, usage, oom_grew, reserve);
    match run.cgroup.take() {
        Some(c) if keep => agent.jobs.keep(c),
        Some(c) => c.release(),
        None => {}
    }
    // Whatever left its cgroup for one of its own dies with the command, job or not: a job
    // stays in (or below) its command's cgroup, where its tree can be told and killed.
    agent.cgroups.kill_strays();
    result
}

fn unreachable_exit() -> ! {
    // The supervisor holds a sender itself, so the channel can never disconnect.
    unreachable!("event channel closed while its owner holds a sender")
}

fn build_result(
    run: &Running,
    o: Outcome,
    mut caps: [Capture; 2],
    usage: Usage,
    oom_grew: bool,
    reserve: usize,
) -> ExecResult {
    let sig = o.exit.signal();
    let reason = match (o.cause, sig) {
        (Some(c), _) => c,
        (None, Some(libc::SIGKILL)) if oom_grew => Reason::Oom,
        // The main process exited, but the OOM killer took part of its tree (a shell
        // reporting its child's death, `make` after a compiler was killed): say so, and keep
        // the exit code the caller would see.
        (None, None) if oom_grew => Reason::Oom,
        (None, Some(_)) if o.caller_signaled => Reason::Killed,
        (None, Some(_)) => Reason::Signaled,
        (None, None) => Reason::Exited,
    };
    let run_ms = o.exit.at.duration_since(run.started).as_secs_f64() * 1000.0;
    let cap = usize::try_from(run.cap).unwrap_or(usize::MAX / 4).max(1);
    let mut budgets = [cap, cap];
    loop {
        let [(stdout, stdout_b64), (stderr, stderr_b64)] = [0, 1].map(|i| {
            let kept = caps[i].render_bytes(budgets[i]);
            match String::from_utf8(kept) {
                Ok(text) => (text, None),
                Err(e) => {
                    let b64 = locker_types::base64::encode(e.as_bytes());
                    (
                        String::from_utf8_lossy(e.as_bytes()).into_owned(),
                        Some(b64),
                    )
                }
            }
        });
        let truncated = [
            caps[0].total() > budgets[0] as u64,
            caps[1].total() > budgets[1] as u64,
        ];
        let output_path = if truncated[0] {
            caps[0].spill_file()
        } else if truncated[1] {
            caps[1].spill_file()
        } else {
            None
        };
        let result = ExecResult {
            call_id: run.call_id.clone(),
            exit_code: o.exit.code(),
            signal: sig.map(sys::signal_name),
            reason,
            stdout,
            stderr,
            stdout_b64,
            stderr_b64,
            stdout_truncated: truncated[0],
            stderr_truncated: truncated[1],
            stdout_bytes: caps[0].total(),
            stderr_bytes: caps[1].total(),
            output_path: output_path.map(|p| p.to_string_lossy().into_owned()),
            timings: Timings {
                queue_ms: 0.0,
                start_ms: run.start_ms,
                run_ms,
                total_ms: 0.0,
            },
            usage: usage.clone(),
            changes: None,
        };
        let size = serde_json::to_vec(&EndBody::Exec(Box::new(result.clone())))
            .map(|v| v.len())
            .unwrap_or(0);
        if size + reserve + 1024 <= MAX_PAYLOAD || (budgets[0] <= 64 && budgets[1] <= 64) {
            return result;
        }
        // Too big for one frame (escaping can multiply bytes): show less of the bigger stream,
        // making sure its file holds all of it.
        let i = if result.stdout.len() >= result.stderr.len() {
            0
        } else {
            1
        };
        budgets[i] = (budgets[i].min(caps[i].total() as usize)) / 2;
        caps[i].ensure_spilled();
    }
}

/// The result of a command whose program could not be executed, as a shell reports it.
pub fn not_started(call_id: &str, argv0: &str, opened: Instant, e: &io::Error) -> ExecResult {
    let code = match e.raw_os_error() {
        Some(libc::ENOENT) => 127,
        _ => 126,
    };
    let stderr = format!("locker: cannot run {argv0:?}: {e}\n");
    ExecResult {
        call_id: call_id.to_string(),
        exit_code: Some(code),
        signal: None,
        reason: Reason::Exited,
        stderr_bytes: stderr.len() as u64,
        stderr,
        stdout: String::new(),
        stdout_b64: None,
        stderr_b64: None,
        stdout_truncated: false,
        stderr_truncated: false,
        stdout_bytes: 0,
        output_path: None,
        timings: Timings {
            start_ms: opened.elapsed().as_secs_f64() * 1000.0,
            ..Default::default()
        },
        usage: Usage::default(),
        changes: None,
    }
}

/// Serves `Request::Exec`.
pub fn run_exec(agent: &Arc<Agent>, s: &Arc<Stream>, mut spec: ExecSpec) {
    if spec.call_id.is_empty() {
        spec.call_id = crate::random_id("call_");
    }
    if let Err(e) = check_id(&spec.call_id) {
        return s.fail(e);
    }
    let prep = match prepare(&spec) {
        Ok(p) => p,
        Err(e) => return s.fail(e),
    };
    let stdin_mode = if spec.stdin && spec.pty.is_none() {
        StdinMode::Pipe
    } else {
        StdinMode::Null
    };
    let streaming = spec.stream_output || spec.pty.is_some();
    let opts = RunOptions {
        name: spec.call_id.clone(),
        max_output_bytes: spec.max_output_bytes.max(1),
        spool: false,
        stream: streaming.then(|| s.clone()),
        progress: None,
        announce: Some(s.clone()),
        kill_jobs: spec.kill_jobs,
    };
    let mut run = match start(
        agent,
        &prep,
        stdin_mode,
        spec.pty,
        opts,
        s.opened,
        &spec.call_id,
    ) {
        Ok(r) => r,
        Err(StartError::Agent(e)) => return s.fail(e),
        Err(StartError::Exec(e)) => {
            return s.end(EndBody::Exec(Box::new(not_started(
                &spec.call_id,
                &prep.argv[0],
                s.opened,
                &e,
            ))))
        }
    };
    let cancel_tx = run.events_tx.clone();
    s.on_cancel(move || {
        let _ = cancel_tx.send(Event::Cancel);
    });
    let input = match (
        run.stdin.take(),
        run.pty_master.as_ref().map(|m| m.try_clone()),
    ) {
        (Some(pipe), _) => Some((Chan::Stdin, pipe, None)),
        (None, Some(Ok(master))) => {
            let fd = master.as_raw_fd();
            Some((Chan::Bytes, master, Some(fd)))
        }
        _ => None,
    };
    if let Some((chan, sink, tty)) = input {
        let st = s.clone();
        if let Err(e) = spawn_thread("input", move || pump_input(&st, chan, sink, tty)) {
            eprintln!("locker-agent: cannot start an input thread: {e}");
        }
    }
    let timeout = spec.timeout_ms.map(Duration::from_millis);
    let result = wait(agent, run, timeout, 0);
    let spilled = result.output_path.is_some();
    s.end(EndBody::Exec(Box::new(result)));
    if spilled {
        crate::spills::prune(&agent.output_dir);
    }
}

/// The spill/spool file of a stream.
pub fn output_file(agent: &Agent, name: &str, ext: &str) -> PathBuf {
    agent.output_dir.join(format!("{name}.{ext}"))
}
