//! Carries out the service tools of `tools_service.rs`: service_start and port_list.
//!
//! service_start is a background process (`POST …/processes`) and a poll of the port list
//! (`GET …/ports`) until the port listens, the process exits, or the wait ends; the URLs are
//! made absolute with the Locker URL the client used. Must not reach the server any other
//! way than through [`Call`].

use std::time::{Duration, Instant};

use http::Method;
use serde_json::{json, Value};

use crate::server::{seg, Call, Fail, Out};
use crate::tools_service::MAX_WAIT_S;

/// How often service_start looks at the port list.
const POLL: Duration = Duration::from_millis(200);

impl Call<'_> {
    /// A port's URL through Locker, absolute when the client's Locker URL is known.
    fn port_url(&self, sb: &str, port: u64) -> String {
        format!(
            "{}/v1/sandboxes/{sb}/ports/{port}/",
            self.base.as_deref().unwrap_or("")
        )
    }

    async fn ports(&self, sb: &str) -> Result<Vec<Value>, Fail> {
        let v = self
            .json(Method::GET, format!("/v1/sandboxes/{sb}/ports"), None)
            .await?;
        Ok(v["ports"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .map(|mut p| {
                let port = p["port"].as_u64().unwrap_or(0);
                p["url"] = json!(self.port_url(sb, port));
                p
            })
            .collect())
    }

    pub(crate) async fn port_list(&self) -> Out {
        let sb = seg(self.need("sandbox_id")?)?.to_owned();
        Ok(json!({ "ports": self.ports(&sb).await? }))
    }

    pub(crate) async fn service_start(&self) -> Out {
        let sb = seg(self.need("sandbox_id")?)?.to_owned();
        let port = self
            .u64("port")?
            .filter(|p| (1..=65535).contains(p))
            .ok_or_else(|| Fail("`port` must be 1-65535".into()))?;
        let wait = Duration::from_secs(self.u64("wait_s")?.unwrap_or(30).clamp(1, MAX_WAIT_S));
        if self.ports(&sb).await?.iter().any(|p| p["port"] == port) {
            return Err(Fail(format!(
                "port {port} already listens in {sb}: port_list shows which program; stop it first or use another port"
            )));
        }
        let body = self.exec_body()?;
        let v = self
            .json(
                Method::POST,
                format!("/v1/sandboxes/{sb}/processes"),
                Some(Value::Object(body)),
            )
            .await?;
        let proc_id = v["id"].as_str().unwrap_or_default().to_owned();
        let started = Instant::now();
        loop {
            if self.ports(&sb).await?.iter().any(|p| p["port"] == port) {
                return Ok(json!({
                    "process_id": proc_id, "pid": v["pid"], "port": port,
                    "url": self.port_url(&sb, port),
                    "waited_ms": started.elapsed().as_millis() as u64,
                }));
            }
            let p = self
                .json(
                    Method::GET,
                    format!("/v1/sandboxes/{sb}/processes/{proc_id}"),
                    None,
                )
                .await?;
            if p["state"] == "exited" {
                let r = &p["result"];
                return Err(Fail(format!(
                    "the server exited before it listened on port {port} (exit_code {}, reason {}): read its output with process_output {{\"sandbox_id\": \"{sb}\", \"process_id\": \"{proc_id}\"}}",
                    r["exit_code"], r["reason"]
                )));
            }
            if started.elapsed() >= wait {
                return Err(Fail(format!(
                    "nothing listens on port {port} after {} s; the server ({proc_id}) still runs: read process_output to see why, stop it with process_kill, or call port_list to see the ports it opened",
                    wait.as_secs()
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }
}
