//! The small calls that answer with one `End`: liveness, a microVM's set-up after a
//! restore (clock, entropy, hostname, network, shares), flushing the disks, and the
//! machine's usage. Each says which answer it expects; any other is a protocol error.

use locker_proto::{EndBody, Request};
use locker_types::Usage;

use super::{unexpected, AgentClient, Result, SLOW_CALL_DEADLINE};

impl AgentClient {
    /// A liveness check.
    pub async fn ping(&self) -> Result<()> {
        match self.call(Request::Ping).await? {
            EndBody::Pong => Ok(()),
            other => Err(unexpected("Ping", &other)),
        }
    }

    /// After a microVM restore: sets the guest's clock, entropy and hostname.
    pub async fn refresh(&self, unix_ns: u64, entropy: Vec<u8>, hostname: String) -> Result<()> {
        let req = Request::Refresh {
            unix_ns,
            entropy,
            hostname,
        };
        match self.call(req).await? {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("Refresh", &other)),
        }
    }

    /// Gives a microVM guest's `interface` its address and default route (see
    /// [`Request::ConfigureNet`]).
    pub async fn configure_net(
        &self,
        interface: &str,
        address: std::net::Ipv4Addr,
        prefix: u8,
        gateway: std::net::Ipv4Addr,
    ) -> Result<()> {
        let req = Request::ConfigureNet {
            interface: interface.to_owned(),
            address,
            prefix,
            gateway,
        };
        match self.call(req).await? {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("ConfigureNet", &other)),
        }
    }

    /// In a microVM: mounts the host tree served on `channel` at `target` (see
    /// [`Request::MountShare`]).
    pub async fn mount_share(&self, channel: u32, target: &str, read_only: bool) -> Result<()> {
        let req = Request::MountShare {
            channel,
            target: target.to_owned(),
            read_only,
        };
        match self.call(req).await? {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("MountShare", &other)),
        }
    }

    /// In a microVM: holds the volume mounts' requests (`true`: none is in flight once this
    /// answers) or relays them again (see [`Request::HoldShares`]).
    pub async fn hold_shares(&self, hold: bool) -> Result<()> {
        match self
            .call_within(Request::HoldShares { hold }, SLOW_CALL_DEADLINE)
            .await?
        {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("HoldShares", &other)),
        }
    }

    /// Flushes every filesystem of the machine to its disks.
    pub async fn flush(&self) -> Result<()> {
        match self.call_within(Request::Flush, SLOW_CALL_DEADLINE).await? {
            EndBody::Ok => Ok(()),
            other => Err(unexpected("Flush", &other)),
        }
    }

    /// The whole machine's CPU time and peak memory so far.
    pub async fn machine_usage(&self) -> Result<Usage> {
        match self.call(Request::MachineUsage).await? {
            EndBody::Usage(u) => Ok(u),
            other => Err(unexpected("MachineUsage", &other)),
        }
    }
}
