//! A microVM's volume mounts held for a snapshot (its user's, a fork's, a move's) and let
//! go again: the guest's relay (the agent's `share`) and the host file server's table
//! (`crate::vm_fs::Carried`, written beside the snapshot's memory as [`FILES_TABLE`]).
//! What a restore does with the table is `create_vm`'s; when to hold and for how long is
//! the caller's.

use std::fs;
use std::future::Future;
use std::path::Path;

use super::{task, Machine, Node, NodeError, FILES_TABLE};

impl Node {
    /// Before a microVM whose volumes are mounted is snapshotted: its guest's relay holds
    /// every request (none in flight), and the file server's mounts and table are written
    /// into snapshot directory `dir` ([`FILES_TABLE`]), which [`Node::snapshot`] then
    /// accepts. Nothing to do for any other machine. The hold lasts until
    /// [`Node::release_shares`] or the machine goes; a failure here leaves the relay as it
    /// was.
    pub async fn hold_shares(&self, m: &Machine, dir: &Path) -> Result<(), NodeError> {
        if m.vm().is_none() || !crate::vm_fs::has_shares(&m.dir) {
            return Ok(());
        }
        if !m.agent.has_feature(locker_proto::FEATURE_SHARE_HOLD) {
            return Err(NodeError::Unavailable(
                "microvm",
                "its agent is of an earlier release, which cannot hold its volume mounts: it cannot move with them".into(),
            ));
        }
        let held = async {
            m.agent.hold_shares(true).await?;
            let (from, to) = (m.dir.clone(), dir.join(FILES_TABLE));
            let written = tokio::task::spawn_blocking(move || {
                let c = crate::vm_fs::Carried::take(&from)?;
                fs::write(&to, serde_json::to_vec(&c).map_err(std::io::Error::other)?)
            })
            .await
            .map_err(task("the file server's table"))?
            .map_err(|source| NodeError::Io {
                step: "reading the file server's table".into(),
                source,
            });
            if written.is_err() {
                let _ = m.agent.hold_shares(false).await;
            }
            written
        };
        self.while_running(m, held).await
    }

    /// Lifts [`Node::hold_shares`]: the guest's volume requests flow again. Nothing to do
    /// for a machine without volume mounts, or whose agent cannot hold them.
    pub async fn release_shares(&self, m: &Machine) -> Result<(), NodeError> {
        let holds = m.vm().is_some()
            && crate::vm_fs::has_shares(&m.dir)
            && m.agent.has_feature(locker_proto::FEATURE_SHARE_HOLD);
        if !holds {
            return Ok(());
        }
        let released = async { Ok(m.agent.hold_shares(false).await?) };
        self.while_running(m, released).await
    }

    /// `work` (which needs the machine's agent) done with the machine running: a paused
    /// one runs for that moment and is paused again.
    async fn while_running<T>(
        &self,
        m: &Machine,
        work: impl Future<Output = Result<T, NodeError>>,
    ) -> Result<T, NodeError> {
        let was_frozen = self.is_frozen(m);
        if was_frozen {
            m.resume()?;
        }
        let done = work.await;
        if was_frozen {
            m.pause()?;
        }
        done
    }
}
