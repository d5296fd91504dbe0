//! Background processes: spawn, list (bounded), look up, replay and follow output, feed
//! stdin, signal.

use locker_proto::{Chan, EndBody, ExecSpec, ProcessInfo, Reply, Request};
use tokio::io::AsyncRead;
use tokio::sync::mpsc;

use super::stream::upload;
use super::{
    unexpected, AgentClient, AgentClientError, AgentStream, Result, StreamEvent, CALL_DEADLINE,
    MAX_LIST_BYTES, MAX_LIST_PROCESSES,
};

impl AgentClient {
    /// Starts a background process: its id (`proc_…`) and pid. With `spec.stdin` its stdin is
    /// a pipe fed by [`process_stdin`](Self::process_stdin); without, `/dev/null`.
    pub async fn spawn(&self, spec: ExecSpec) -> Result<(String, i32)> {
        match self.call(Request::Spawn(spec)).await? {
            EndBody::Spawned { id, pid } => Ok((id, pid)),
            other => Err(unexpected("Spawn", &other)),
        }
    }

    /// Starts a background process and opens the following of its output from its start
    /// (see [`Following`]): one agent round trip where the agent serves it
    /// ([`locker_proto::FEATURE_SPAWN_FOLLOW`]), else [`spawn`](Self::spawn) then
    /// `ProcessOutput`, with the same result.
    pub async fn spawn_follow(&self, spec: ExecSpec) -> Result<(String, i32, Following)> {
        if !self.has_feature(locker_proto::FEATURE_SPAWN_FOLLOW) {
            let (id, pid) = self.spawn(spec).await?;
            let following = self.follow_process(&id)?;
            return Ok((id, pid, following));
        }
        let mut s = self.open(Request::SpawnFollow(spec))?;
        match s.recv_within(CALL_DEADLINE).await? {
            Some(StreamEvent::Msg(Reply::Spawned { id, pid })) => {
                Ok((id, pid, Following { stream: s }))
            }
            Some(StreamEvent::End(EndBody::Error(e))) => Err(e.into()),
            Some(StreamEvent::End(other)) => Err(unexpected("SpawnFollow", &other)),
            Some(_) => Err(AgentClientError::Protocol(
                "a SpawnFollow request's first answer is not Spawned".into(),
            )),
            None => Err(s.lost()),
        }
    }

    /// Opens the following of a background process's output from its start to its end.
    pub fn follow_process(&self, id: &str) -> Result<Following> {
        let stream = self.open(Request::ProcessOutput {
            id: id.into(),
            follow: true,
        })?;
        Ok(Following { stream })
    }

    /// Every background process the agent remembers, running or ended.
    pub async fn list_processes(&self) -> Result<Vec<ProcessInfo>> {
        let mut s = self.open(Request::ListProcesses)?;
        let mut all = Vec::new();
        let mut bytes = 0usize;
        let mut take = |batch: Vec<ProcessInfo>, all: &mut Vec<ProcessInfo>| {
            for p in batch {
                bytes += process_cost(&p);
                if all.len() >= MAX_LIST_PROCESSES || bytes > MAX_LIST_BYTES {
                    return Err(AgentClientError::TooLarge(format!(
                        "the machine's list of background processes passed {MAX_LIST_PROCESSES} \
                         processes or {} MiB; signal or wait for some of them",
                        MAX_LIST_BYTES >> 20
                    )));
                }
                all.push(p);
            }
            Ok(())
        };
        loop {
            match s.recv_within(CALL_DEADLINE).await? {
                Some(StreamEvent::Msg(Reply::Processes { processes })) => {
                    take(processes, &mut all)?
                }
                Some(StreamEvent::End(EndBody::Processes(batch))) => {
                    take(batch, &mut all)?;
                    return Ok(all);
                }
                Some(StreamEvent::End(EndBody::Error(e))) => return Err(e.into()),
                Some(StreamEvent::End(other)) => return Err(unexpected("ListProcesses", &other)),
                Some(_) => {}
                None => return Err(s.lost()),
            }
        }
    }

    /// One background process, with its result once it has ended.
    pub async fn get_process(&self, id: &str) -> Result<ProcessInfo> {
        match self.call(Request::GetProcess { id: id.into() }).await? {
            EndBody::Process(p) => Ok(*p),
            other => Err(unexpected("GetProcess", &other)),
        }
    }

    /// Replays a background process's output from its start into `output`, then (with
    /// `follow`) what comes until it ends; returns its state at the end of the replay.
    pub async fn process_output(
        &self,
        id: &str,
        follow: bool,
        output: mpsc::Sender<(Chan, Vec<u8>)>,
    ) -> Result<ProcessInfo> {
        let stream = self.open(Request::ProcessOutput {
            id: id.into(),
            follow,
        })?;
        Following { stream }.output(output).await
    }

    /// Writes `data` to a background process's stdin; with `close` its stdin is closed
    /// afterwards (the process sees end of file).
    pub async fn process_stdin(
        &self,
        id: &str,
        data: impl AsyncRead + Unpin,
        close: bool,
    ) -> Result<()> {
        let s = self.open(Request::ProcessStdin { id: id.into() })?;
        let end_chan = if close { Chan::Stdin } else { Chan::Bytes };
        match upload(s, Chan::Stdin, data, end_chan, None).await? {
            EndBody::Ok => Ok(()),
            EndBody::Error(e) => Err(e.into()),
            other => Err(unexpected("ProcessStdin", &other)),
        }
    }

    /// Resizes the terminal of a background process started with a pty.
    pub async fn resize_process(&self, id: &str, size: locker_proto::PtySize) -> Result<()> {
        match self
            .call(Request::ResizeProcess {
                id: id.into(),
                size,
            })
            .await?
        {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("ResizeProcess", &other)),
        }
    }

    /// Sends a signal (a number, e.g. `libc::SIGTERM`) to a background process's whole tree.
    pub async fn signal_process(&self, id: &str, signal: i32) -> Result<()> {
        match self
            .call(Request::SignalProcess {
                id: id.into(),
                signal,
            })
            .await?
        {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("SignalProcess", &other)),
        }
    }
}

/// What a process counts for against [`MAX_LIST_BYTES`]: its strings plus a fixed share
/// for the rest (a result's output bodies are empty in a list).
fn process_cost(p: &ProcessInfo) -> usize {
    let result = p
        .result
        .as_ref()
        .map_or(0, |r| 512 + r.stdout.len() + r.stderr.len());
    let env: usize = p.env.iter().map(|(k, v)| k.len() + v.len() + 8).sum();
    let cwd = p.cwd.as_ref().map_or(0, |c| c.len());
    p.id.len()
        + p.state.len()
        + p.argv.iter().map(|a| a.len() + 4).sum::<usize>()
        + env
        + cwd
        + result
        + 96
}

/// The output of a background process being followed (from [`AgentClient::spawn_follow`]
/// or [`AgentClient::follow_process`]). Dropping it stops the following, not the process.
pub struct Following {
    stream: AgentStream,
}

impl Following {
    /// Passes the output into `output` as it comes, from the process's start, until it
    /// ends; returns the process's state at its end. Credit goes back to the agent only as
    /// `output` takes the chunks.
    pub async fn output(mut self, output: mpsc::Sender<(Chan, Vec<u8>)>) -> Result<ProcessInfo> {
        let s = &mut self.stream;
        loop {
            match s.recv_raw().await? {
                Some(StreamEvent::Data(chan, bytes)) => {
                    let n = bytes.len();
                    let _ = output.send((chan, bytes)).await;
                    s.ack(chan, n);
                }
                Some(StreamEvent::End(EndBody::Process(p))) => return Ok(*p),
                Some(StreamEvent::End(EndBody::Error(e))) => return Err(e.into()),
                Some(StreamEvent::End(other)) => return Err(unexpected("ProcessOutput", &other)),
                Some(_) => {}
                None => return Err(s.lost()),
            }
        }
    }
}
