//! The one owner of `waitpid`: every child of the agent, and every orphan re-parented to it,
//! is reaped here.
//!
//! A single thread waits for any exited child. It first only *peeks* (`waitid` with
//! `WNOWAIT`), then takes the registry lock before reaping, and spawners hold that same lock
//! across `fork` + registration. So a command that exits instantly can never be reaped before
//! its spawner registered interest in it, and nothing else in the agent calls `wait*` (which
//! is why `std::process::Child::wait` is never used: it would race this thread).

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::sys;

/// How a registered child ended.
#[derive(Debug, Clone, Copy)]
pub struct ExitInfo {
    /// The raw wait status.
    pub status: i32,
    /// CPU time of the child and the descendants it waited for, in ms.
    pub cpu_ms: u64,
    /// Peak resident set size of the child, in bytes.
    pub max_rss_bytes: u64,
    /// When it was reaped.
    pub at: Instant,
}

impl ExitInfo {
    /// The exit code, if it exited normally.
    pub fn code(&self) -> Option<i32> {
        libc::WIFEXITED(self.status).then(|| libc::WEXITSTATUS(self.status))
    }

    /// The signal that ended it, if one did.
    pub fn signal(&self) -> Option<i32> {
        libc::WIFSIGNALED(self.status).then(|| libc::WTERMSIG(self.status))
    }
}

type OnExit = Box<dyn FnOnce(ExitInfo) + Send>;

/// How long the reaper sleeps without children before it looks again anyway.
const IDLE_GUARD: Duration = Duration::from_secs(60);

struct Registry {
    waiting: HashMap<i32, OnExit>,
    /// Bumped by every spawn, so the reaper thread can sleep while there are no children.
    generation: u64,
}

/// A handle on the reaper thread.
#[derive(Clone)]
pub struct Reaper {
    inner: Arc<(Mutex<Registry>, Condvar)>,
}

impl Reaper {
    /// Starts the reaper thread.
    pub fn start() -> io::Result<Reaper> {
        let inner = Arc::new((
            Mutex::new(Registry {
                waiting: HashMap::new(),
                generation: 0,
            }),
            Condvar::new(),
        ));
        let thread_inner = inner.clone();
        std::thread::Builder::new()
            .name("reaper".into())
            .stack_size(128 * 1024)
            .spawn(move || reap_forever(&thread_inner))?;
        Ok(Reaper { inner })
    }

    /// Runs `spawn` (which forks and returns the child's pid) with the registry locked, and
    /// registers `on_exit` for that pid. `on_exit` runs on the reaper thread: keep it short.
    pub fn spawn<T>(
        &self,
        spawn: impl FnOnce() -> io::Result<(i32, T)>,
        on_exit: impl FnOnce(ExitInfo) + Send + 'static,
    ) -> io::Result<(i32, T)> {
        let (lock, cond) = &*self.inner;
        let mut reg = lock.lock().unwrap_or_else(|e| e.into_inner());
        let (pid, extra) = spawn()?;
        reg.waiting.insert(pid, Box::new(on_exit));
        reg.generation += 1;
        cond.notify_all();
        Ok((pid, extra))
    }
}

fn reap_forever(inner: &(Mutex<Registry>, Condvar)) {
    let (lock, cond) = inner;
    loop {
        let generation = lock.lock().unwrap_or_else(|e| e.into_inner()).generation;
        match sys::wait_any_exited_peek() {
            Ok(pid) => {
                let mut reg = lock.lock().unwrap_or_else(|e| e.into_inner());
                // Err or None: someone else reaped it (std's spawn does when exec fails) or it
                // is not quite gone yet; peek again.
                if let Ok(Some((status, ru))) = sys::reap(pid) {
                    let cb = reg.waiting.remove(&pid);
                    drop(reg);
                    if let Some(cb) = cb {
                        let info = ExitInfo {
                            status,
                            cpu_ms: sys::rusage_cpu_ms(&ru),
                            max_rss_bytes: ru.ru_maxrss.max(0) as u64 * 1024,
                            at: Instant::now(),
                        };
                        cb(info);
                    }
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::ECHILD) => {
                let reg = lock.lock().unwrap_or_else(|e| e.into_inner());
                // Sleep until a spawn happens. The timeout only guards against a child that
                // came without one (a process that joined the machine from outside and was
                // re-parented here): its zombie waits at most that long. It is long because
                // every idle machine pays its wake-ups (a thousand idle sandboxes at 5 s
                // were 200 wake-ups a second on the host).
                let _ = cond
                    .wait_timeout_while(reg, IDLE_GUARD, |r| r.generation == generation)
                    .unwrap_or_else(|e| e.into_inner());
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("locker-agent: waitid failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}
