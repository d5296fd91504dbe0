//! Jobs: what a command left running when it ended (`cmd &`, `nohup`, `setsid`, daemons).
//!
//! An exec ends when its own process does; what it started and left behind keeps running in
//! the machine, as after `docker exec` (`exec::wait` decides when, from `ExecSpec::kill_jobs`
//! and how the command ended). This room keeps two things alive for those survivors:
//! - their **cgroup**: the command's cgroup stays, registered as live so that the stray
//!   sweep never takes it, until it is empty ([`Jobs::reap`], run when the next command
//!   starts). The survivors stay inside the machine's cgroup, so its limits hold and its
//!   usage counts them;
//! - the **output pipes** they inherited: after the command's own output is drained they are
//!   handed to one drain thread that reads and discards whatever the jobs write, so a server
//!   logging each request does not die of `SIGPIPE`/`EPIPE` once its exec is over.
//!
//! It owns no policy about when a tree is killed (that is `exec`) and no cgroup layout (that
//! is `cgroup`). A job that moves itself out of its command's cgroup to one beside the
//! commands' is a stray and dies when any command ends (`Cgroups::kill_strays`). Hostile
//! jobs are bounded: at most [`MAX_HELD_FDS`] pipes are drained at once (beyond that a job's
//! pipes are closed and its writes fail, as when a terminal closes); the drain's reads are
//! charged to the machine, whose cgroup the agent is in.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, OnceLock};

use crate::cgroup::CmdCgroup;
use crate::sys;

/// How many survivors' pipes are drained at once at most.
pub const MAX_HELD_FDS: usize = 512;

/// The survivors of ended commands.
#[derive(Default)]
pub struct Jobs {
    cgroups: Mutex<Vec<Arc<CmdCgroup>>>,
    drain: Arc<Drain>,
}

impl Jobs {
    /// Keeps an ended command's cgroup, which still has members, until it is empty.
    pub fn keep(&self, cgroup: Arc<CmdCgroup>) {
        lock(&self.cgroups).push(cgroup);
    }

    /// Removes the cgroups of jobs that have all ended. Nothing to do (one lock) when no
    /// command left anything running.
    pub fn reap(&self) {
        let mut kept = lock(&self.cgroups);
        if kept.is_empty() {
            return;
        }
        kept.retain(|c| {
            if c.pids().is_empty() {
                c.release();
                false
            } else {
                true
            }
        });
    }

    /// The drain that survivors' output pipes are handed to.
    pub fn drain(&self) -> Arc<Drain> {
        self.drain.clone()
    }
}

/// One thread reading (and discarding) the output pipes jobs still hold.
#[derive(Default)]
pub struct Drain {
    /// Pipes handed over and not yet picked up by the thread.
    pending: Mutex<Vec<OwnedFd>>,
    /// Wakes the thread for new pipes; `None` when it could not start.
    wake: OnceLock<Option<UnixStream>>,
}

impl Drain {
    /// Takes over `fds` (read ends whose writers outlived their command).
    pub fn adopt(self: &Arc<Self>, fds: Vec<OwnedFd>) {
        if fds.is_empty() {
            return;
        }
        let wake = self.wake.get_or_init(|| self.start());
        let Some(wake) = wake else {
            // No thread: the pipes close here and the jobs' writes fail, as before jobs.
            return;
        };
        lock(&self.pending).extend(fds);
        // A full wake buffer already means "pending"; nothing is lost by a failed write.
        let _ = (&*wake).write(&[1]);
    }

    fn start(self: &Arc<Self>) -> Option<UnixStream> {
        let (tx, rx) = match UnixStream::pair() {
            Ok(p) => p,
            Err(e) => {
                eprintln!("locker-agent: no drain for jobs' output: {e}");
                return None;
            }
        };
        if tx.set_nonblocking(true).is_err() || rx.set_nonblocking(true).is_err() {
            return None;
        }
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("jobs-drain".into())
            .stack_size(128 * 1024)
            .spawn(move || me.run(rx));
        match spawned {
            Ok(_) => Some(tx),
            Err(e) => {
                eprintln!("locker-agent: no drain for jobs' output: {e}");
                None
            }
        }
    }

    fn run(&self, mut wake: UnixStream) {
        let mut held: Vec<OwnedFd> = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let mut fds: Vec<RawFd> = held.iter().map(|f| f.as_raw_fd()).collect();
            fds.push(wake.as_raw_fd());
            let Ok(revents) = sys::poll(&fds, -1) else {
                // EINTR; anything else must not turn into a busy loop.
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            };
            let mut gone = Vec::new();
            for (i, re) in revents[..held.len()].iter().enumerate() {
                if *re == 0 {
                    continue;
                }
                match sys::read(fds[i], &mut buf) {
                    Ok(0) | Err(_) => gone.push(i),
                    Ok(_) => {}
                }
            }
            for i in gone.into_iter().rev() {
                held.swap_remove(i);
            }
            if revents.last().is_some_and(|r| *r != 0) {
                while matches!(wake.read(&mut buf), Ok(n) if n > 0) {}
                let mut new = std::mem::take(&mut *lock(&self.pending));
                let room = MAX_HELD_FDS.saturating_sub(held.len());
                if new.len() > room {
                    eprintln!(
                        "locker-agent: {} jobs' output pipes held already; closing {} more",
                        held.len(),
                        new.len() - room
                    );
                    new.truncate(room);
                }
                held.extend(new);
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
