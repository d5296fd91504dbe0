//! Background processes: started by `Spawn`, listed, followed, fed and signalled by id.
//!
//! Each process's output goes to spool files in the output directory from its first byte
//! (`<dir>/<proc id>.stdout|.stderr`, bounded by the spill limit), so `ProcessOutput` can
//! replay it from the start and follow it to the end without the agent holding it in memory.
//! The result is kept once the process has ended; the oldest ended processes are forgotten
//! (and their spool files deleted) past [`MAX_ENDED`].

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use locker_proto::{
    AgentError, Chan, EndBody, ErrorCode, ExecSpec, ProcessInfo, Reply, MAX_PAYLOAD,
};
use locker_types::ExecResult;

use crate::cgroup::CmdCgroup;
use crate::conn::{Inbound, Recv, Stream};
use crate::exec::{self, Event, RunOptions, StartError, StdinMode};
use crate::{sys, Agent};

/// How many ended processes are remembered.
pub const MAX_ENDED: usize = 256;

/// The table of background processes.
#[derive(Default)]
pub struct Procs {
    map: Mutex<HashMap<String, Arc<Proc>>>,
    ended: Mutex<VecDeque<String>>,
}

/// Output progress and the final result, shared with the output pump.
#[derive(Default)]
struct Progress {
    written: [u64; 2],
    result: Option<ExecResult>,
}

struct Proc {
    id: String,
    pid: i32,
    argv: Vec<String>,
    cwd: Option<String>,
    env: Vec<(String, String)>,
    started_at: String,
    stdin: Mutex<Option<File>>,
    /// The terminal's master side, for resizes (a process started with `pty`).
    pty: Option<File>,
    events: Mutex<Sender<Event>>,
    cgroup: Option<Arc<CmdCgroup>>,
    progress: Arc<(Mutex<Progress>, Condvar)>,
    spool: [PathBuf; 2],
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Proc {
    fn info(&self) -> ProcessInfo {
        let result = lock(&self.progress.0).result.clone();
        ProcessInfo {
            id: self.id.clone(),
            pid: self.pid,
            argv: self.argv.clone(),
            state: if result.is_some() {
                "exited"
            } else {
                "running"
            }
            .into(),
            started_at: self.started_at.clone(),
            result,
            pty: self.pty.is_some(),
            cwd: self.cwd.clone(),
            env: self.env.clone(),
        }
    }
}

fn find(agent: &Agent, id: &str) -> Result<Arc<Proc>, AgentError> {
    lock(&agent.procs.map)
        .get(id)
        .cloned()
        .ok_or_else(|| AgentError::new(ErrorCode::NotFound, format!("no background process {id}")))
}

fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    locker_types::rfc3339(secs as i64)
}

/// Serves `Request::Spawn` (`follow` false: `End(Spawned)` at once) and
/// `Request::SpawnFollow` (`follow`: `Msg(Spawned)` at once, then the output is followed
/// on this stream by a thread of its own, as `ProcessOutput` would); then supervises the
/// process on this thread.
pub fn spawn(agent: &Arc<Agent>, s: &Arc<Stream>, spec: ExecSpec, follow: bool) {
    let id = crate::random_id("proc_");
    let call_id = if spec.call_id.is_empty() {
        id.clone()
    } else {
        spec.call_id.clone()
    };
    if let Err(e) = exec::check_id(&call_id) {
        return s.fail(e);
    }
    let prep = match exec::prepare(&spec) {
        Ok(p) => p,
        Err(e) => return s.fail(e),
    };
    let progress: Arc<(Mutex<Progress>, Condvar)> = Arc::default();
    let p2 = progress.clone();
    let opts = RunOptions {
        name: id.clone(),
        max_output_bytes: spec.max_output_bytes.max(1),
        spool: true,
        stream: None,
        progress: Some(Arc::new(move |i, n| {
            lock(&p2.0).written[i] = n;
            p2.1.notify_all();
        })),
        announce: None,
        kill_jobs: spec.kill_jobs,
    };
    let stdin_mode = if spec.stdin {
        StdinMode::Pipe
    } else {
        StdinMode::Null
    };
    let mut run = match exec::start(agent, &prep, stdin_mode, spec.pty, opts, s.opened, &call_id) {
        Ok(r) => r,
        Err(StartError::Agent(e)) => return s.fail(e),
        Err(StartError::Exec(e)) => {
            return s.fail(AgentError::new(
                ErrorCode::BadRequest,
                format!("cannot run {:?}: {e}", prep.argv[0]),
            ))
        }
    };
    let stdin = run
        .stdin
        .take()
        .or_else(|| run.pty_master.as_ref().and_then(|m| m.try_clone().ok()));
    let proc = Arc::new(Proc {
        id: id.clone(),
        pid: run.pid,
        argv: prep.argv.clone(),
        cwd: spec.cwd.clone(),
        env: spec.env.clone(),
        started_at: now_rfc3339(),
        stdin: Mutex::new(stdin),
        pty: run.pty_master.as_ref().and_then(|m| m.try_clone().ok()),
        events: Mutex::new(run.events_tx.clone()),
        cgroup: run.cgroup.clone(),
        progress: progress.clone(),
        spool: [
            exec::output_file(agent, &id, "stdout"),
            exec::output_file(agent, &id, "stderr"),
        ],
    });
    lock(&agent.procs.map).insert(id.clone(), proc.clone());
    if follow {
        follow_on_own_thread(agent, s, &id, run.pid);
    } else {
        s.end(EndBody::Spawned {
            id: id.clone(),
            pid: run.pid,
        });
    }

    // Room for the rest of a ProcessInfo around the result, so GetProcess always fits a frame.
    let reserve = serde_json::to_vec(&(&proc.argv, &proc.cwd, &proc.env))
        .map(|v| v.len())
        .unwrap_or(0)
        + 1024;
    let timeout = spec.timeout_ms.map(Duration::from_millis);
    let result = exec::wait(agent, run, timeout, reserve);
    *lock(&proc.stdin) = None;
    {
        let mut p = lock(&progress.0);
        p.result = Some(result);
        progress.1.notify_all();
    }
    let evicted = {
        let mut ended = lock(&agent.procs.ended);
        ended.push_back(id);
        let mut out = Vec::new();
        while ended.len() > MAX_ENDED {
            if let Some(old) = ended.pop_front() {
                out.push(old);
            }
        }
        out
    };
    for old in evicted {
        if let Some(p) = lock(&agent.procs.map).remove(&old) {
            for f in &p.spool {
                let _ = std::fs::remove_file(f);
            }
        }
    }
}

/// `SpawnFollow`'s answer: `Msg(Spawned)`, then the output followed to the end by a
/// thread of its own (the spawning thread supervises the process). The process runs on
/// whether or not the following starts or lasts.
fn follow_on_own_thread(agent: &Arc<Agent>, s: &Arc<Stream>, id: &str, pid: i32) {
    let spawned = Reply::Spawned {
        id: id.to_owned(),
        pid,
    };
    if s.msg(spawned).is_err() {
        return;
    }
    let (agent2, s2, id2) = (agent.clone(), s.clone(), id.to_owned());
    let started = std::thread::Builder::new()
        .name(format!("follow-{}", s.id))
        .stack_size(512 * 1024)
        .spawn(move || output(&agent2, &s2, &id2, true));
    if let Err(e) = started {
        s.fail(AgentError::new(
            ErrorCode::Busy,
            format!(
                "{id} runs, but its output cannot be followed: no thread ({e}); \
                 follow it with ProcessOutput"
            ),
        ));
    }
}

/// Serves `Request::ListProcesses`, in batches if the list is long.
pub fn list(agent: &Agent, s: &Stream) {
    let mut procs: Vec<Arc<Proc>> = lock(&agent.procs.map).values().cloned().collect();
    procs.sort_by(|a, b| (&a.started_at, &a.id).cmp(&(&b.started_at, &b.id)));
    let mut batch = Vec::new();
    let mut size = 0;
    for p in procs {
        let info = p.info();
        let n = serde_json::to_vec(&info).map(|v| v.len()).unwrap_or(0) + 1;
        if size + n > MAX_PAYLOAD / 2 && !batch.is_empty() {
            if s.msg(Reply::Processes {
                processes: std::mem::take(&mut batch),
            })
            .is_err()
            {
                return;
            }
            size = 0;
        }
        size += n;
        batch.push(info);
    }
    s.end(EndBody::Processes(batch));
}

/// Serves `Request::GetProcess`.
pub fn get(agent: &Agent, s: &Stream, id: &str) {
    match find(agent, id) {
        Ok(p) => s.end(EndBody::Process(Box::new(p.info()))),
        Err(e) => s.fail(e),
    }
}

/// Serves `Request::ProcessOutput`: replays the spool files, then follows them if asked.
pub fn output(agent: &Agent, s: &Stream, id: &str, follow: bool) {
    let p = match find(agent, id) {
        Ok(p) => p,
        Err(e) => return s.fail(e),
    };
    let mut files: [Option<File>; 2] = [None, None];
    let mut sent = [0u64; 2];
    let mut buf = vec![0u8; locker_proto::DATA_CHUNK];
    loop {
        let (written, ended) = {
            let st = lock(&p.progress.0);
            (st.written, st.result.is_some())
        };
        let mut moved = false;
        for i in 0..2 {
            if written[i] <= sent[i] {
                continue;
            }
            if files[i].is_none() {
                match File::open(&p.spool[i]) {
                    Ok(f) => files[i] = Some(f),
                    Err(e) => {
                        return s.fail(AgentError::new(
                            ErrorCode::NotFound,
                            format!("output of {id} is gone: {e}"),
                        ))
                    }
                }
            }
            let want = ((written[i] - sent[i]) as usize).min(buf.len());
            let Some(f) = &files[i] else { continue };
            let n = match f.read_at(&mut buf[..want], sent[i]) {
                Ok(n) => n,
                Err(e) => {
                    return s.fail(AgentError::new(
                        ErrorCode::Internal,
                        format!("reading output of {id}: {e}"),
                    ))
                }
            };
            if n == 0 {
                continue;
            }
            let chan = if i == 0 { Chan::Stdout } else { Chan::Stderr };
            if s.data(chan, &buf[..n]).is_err() {
                return;
            }
            sent[i] += n as u64;
            moved = true;
        }
        if moved {
            continue;
        }
        if ended || !follow {
            break;
        }
        if s.is_cancelled() {
            return;
        }
        let st = lock(&p.progress.0);
        if st.written == written && st.result.is_none() {
            drop(p.wait_progress(st));
        }
    }
    s.end(EndBody::Process(Box::new(p.info())));
}

impl Proc {
    /// Waits (briefly) for more output or the end.
    fn wait_progress<'a>(&'a self, st: MutexGuard<'a, Progress>) -> MutexGuard<'a, Progress> {
        self.progress
            .1
            .wait_timeout(st, Duration::from_millis(200))
            .unwrap_or_else(|e| e.into_inner())
            .0
    }
}

/// Serves `Request::ProcessStdin`.
pub fn stdin(agent: &Agent, s: &Stream, id: &str) {
    let p = match find(agent, id) {
        Ok(p) => p,
        Err(e) => return s.fail(e),
    };
    let closed = || {
        AgentError::new(
            ErrorCode::Conflict,
            format!("the standard input of {id} is closed (or it was started without stdin)"),
        )
    };
    if lock(&p.stdin).is_none() {
        return s.fail(closed());
    }
    // The lock is taken per chunk, never while waiting for the host: an idle request must not
    // keep the supervisor from closing stdin when the process ends.
    loop {
        match s.recv(None) {
            Recv::Item(Inbound::Data(chan, bytes)) => {
                let mut guard = lock(&p.stdin);
                let res = guard.as_mut().map(|f| f.write_all(&bytes));
                s.credit(chan, bytes.len());
                match res {
                    None => return s.fail(closed()),
                    Some(Err(e)) => {
                        *guard = None;
                        return s.fail(AgentError::new(
                            ErrorCode::Conflict,
                            format!("{id} closed its standard input: {e}"),
                        ));
                    }
                    Some(Ok(())) => {}
                }
            }
            Recv::Item(Inbound::Eof(Chan::Bytes)) => return s.end(EndBody::Ok),
            Recv::Item(Inbound::Eof(_)) => {
                *lock(&p.stdin) = None;
                return s.end(EndBody::Ok);
            }
            Recv::Item(Inbound::Control(_)) | Recv::Timeout => {}
            Recv::Gone => return,
        }
    }
}

/// Serves `Request::SignalProcess`: the signal goes to every process of the command's cgroup
/// (or its process group where there are no cgroups).
pub fn signal(agent: &Agent, s: &Stream, id: &str, sig: i32) {
    let p = match find(agent, id) {
        Ok(p) => p,
        Err(e) => return s.fail(e),
    };
    if !(1..=64).contains(&sig) {
        return s.fail(AgentError::new(
            ErrorCode::BadRequest,
            format!("{sig} is not a signal number"),
        ));
    }
    if lock(&p.progress.0).result.is_some() {
        return s.fail(AgentError::new(
            ErrorCode::Conflict,
            format!("{id} has already ended"),
        ));
    }
    let _ = lock(&p.events).send(Event::CallerSignal);
    match &p.cgroup {
        Some(cg) if sig == libc::SIGKILL => exec::kill_tree(p.pid, Some(cg)),
        Some(cg) => cg.signal_all(sig),
        None => {
            let _ = sys::kill(-p.pid, sig);
        }
    }
    s.end(EndBody::Ok);
}

/// Serves `Request::ResizeProcess`.
pub fn resize(agent: &Agent, s: &Stream, id: &str, size: locker_proto::PtySize) {
    let p = match find(agent, id) {
        Ok(p) => p,
        Err(e) => return s.fail(e),
    };
    let Some(master) = &p.pty else {
        return s.fail(AgentError::new(
            ErrorCode::BadRequest,
            format!("{id} does not run on a terminal: only a pty process can be resized"),
        ));
    };
    use std::os::fd::AsRawFd;
    match sys::set_winsize(master.as_raw_fd(), size.cols.max(1), size.rows.max(1)) {
        Ok(()) => s.end(EndBody::Ok),
        Err(e) => s.fail(AgentError::new(
            ErrorCode::Conflict,
            format!("resizing the terminal of {id}: {e}"),
        )),
    }
}
