//! Running one command to its end over a stream: its stdin fed, its output passed on with
//! flow control, and the deadline of [`EXEC_GRACE`] past its own timeout.

use std::time::Duration;

use locker_proto::{Chan, EndBody, ExecSpec, Request};
use locker_types::ExecResult;
use tokio::sync::mpsc;

use super::{unexpected, AgentClient, AgentClientError, Result, StreamEvent, EXEC_GRACE};

impl AgentClient {
    /// Runs a command to its end. `stdin` is fed to it then closed (without it, stdin is
    /// `/dev/null`). With `output`, stdout and stderr chunks are sent there as they come (and
    /// `spec.stream_output` is set); the agent is only given credit for more as `output`
    /// accepts them. Dropping the future before it completes kills the command's tree.
    pub async fn exec(
        &self,
        mut spec: ExecSpec,
        stdin: Option<Vec<u8>>,
        output: Option<mpsc::Sender<(Chan, Vec<u8>)>>,
    ) -> Result<ExecResult> {
        spec.stdin = stdin.is_some();
        spec.stream_output = output.is_some();
        let first = spec
            .timeout_ms
            .map(|t| Duration::from_millis(t).saturating_add(EXEC_GRACE));
        let mut stream = self.open(Request::Exec(spec))?;
        let sender = stream.sender();
        let feed = async move {
            if let Some(data) = stdin {
                if sender.send_data(Chan::Stdin, &data).await.is_ok() {
                    let _ = sender.send_eof(Chan::Stdin);
                }
            }
            std::future::pending::<()>().await
        };
        let read = async {
            // One timer for the whole call. When it fires, the exec fails only if nothing
            // came since it was last armed; otherwise it is re-armed for EXEC_GRACE. The
            // per-message cost is one counter increment.
            let far = Duration::from_secs(100 * 365 * 24 * 3600);
            let timer = tokio::time::sleep(first.unwrap_or(far));
            tokio::pin!(timer);
            let (mut seen, mut armed_at) = (0u64, 0u64);
            loop {
                let ev = tokio::select! {
                    biased;
                    ev = stream.recv_raw() => ev?,
                    _ = &mut timer, if first.is_some() => {
                        if seen == armed_at {
                            return Err(AgentClientError::Unresponsive(
                                first.unwrap_or(far),
                            ));
                        }
                        armed_at = seen;
                        timer.as_mut().reset(tokio::time::Instant::now() + EXEC_GRACE);
                        continue;
                    }
                };
                seen += 1;
                match ev {
                    Some(StreamEvent::Data(chan, bytes)) => {
                        let n = bytes.len();
                        if let Some(tx) = &output {
                            // A receiver that went away just means nobody watches any more.
                            let _ = tx.send((chan, bytes)).await;
                        }
                        stream.ack(chan, n);
                    }
                    Some(StreamEvent::End(EndBody::Exec(r))) => return Ok(*r),
                    Some(StreamEvent::End(EndBody::Error(e))) => {
                        return Err(AgentClientError::Agent(e))
                    }
                    Some(StreamEvent::End(other)) => return Err(unexpected("Exec", &other)),
                    Some(StreamEvent::Msg(_) | StreamEvent::Eof(_)) => {}
                    None => {
                        return Err(AgentClientError::ConnectionLost(
                            "stream ended without a result".into(),
                        ))
                    }
                }
            }
        };
        tokio::select! {
            r = read => r,
            _ = feed => unreachable!("the stdin feeder never completes"),
        }
    }
}
