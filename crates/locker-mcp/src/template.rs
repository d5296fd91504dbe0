//! Carries out the template tools of `tools_template.rs`: template_build (start a build,
//! then poll its state until it ends) and template_list.
//!
//! Each is a few calls of Locker's public API through the same [`Call`] as the other tools;
//! must not reach the server any other way.

use std::time::{Duration, Instant};

use http::Method;
use serde_json::{json, Map, Value};

use crate::server::{seg, Call, Fail, Out};

const TEMPLATE_FIELDS: &[&str] = &[
    "name",
    "digest",
    "size_bytes",
    "created_at",
    "env",
    "workdir",
    "user",
    "start_cmd",
];

fn brief(v: &Value) -> Value {
    let m: Map<String, Value> = TEMPLATE_FIELDS
        .iter()
        .filter_map(|f| v.get(*f).map(|x| ((*f).to_owned(), x.clone())))
        .collect();
    Value::Object(m)
}

impl Call<'_> {
    pub(crate) async fn template_list(&self) -> Out {
        let v = self
            .json(Method::GET, "/v1/templates".to_owned(), None)
            .await?;
        let list: Vec<Value> = v["templates"]
            .as_array()
            .map(|a| a.iter().map(brief).collect())
            .unwrap_or_default();
        Ok(json!({ "templates": list }))
    }

    pub(crate) async fn template_build(&self) -> Out {
        let name = self.need("name")?.to_owned();
        let mut body = json!({ "name": name });
        if let Some(d) = self.str("dockerfile") {
            if self.args.contains_key("from_template")
                || self.args.contains_key("run")
                || self.args.contains_key("packages")
            {
                return Err(Fail(
                    "give either `dockerfile` or from_template/run/packages, not both".into(),
                ));
            }
            body["from"] = json!({ "dockerfile": d });
        } else {
            body["from"] = json!({ "template": self.str("from_template").unwrap_or("default") });
        }
        for k in [
            "run",
            "packages",
            "build_args",
            "env",
            "workdir",
            "user",
            "start_cmd",
            "network",
        ] {
            if let Some(v) = self.args.get(k) {
                body[k] = v.clone();
            }
        }
        let started = self
            .json(Method::POST, "/v1/templates".to_owned(), Some(body))
            .await?;
        let id = started["build_id"]
            .as_str()
            .ok_or_else(|| Fail("the server answered no build_id".into()))?
            .to_owned();
        let timeout = Duration::from_secs(self.u64("timeout_s")?.unwrap_or(1200));
        let until = Instant::now() + timeout;
        loop {
            let b = self
                .json(
                    Method::GET,
                    format!("/v1/templates/builds/{}", seg(&id)?),
                    None,
                )
                .await?;
            let tail: Vec<Value> = b["log"]
                .as_array()
                .map(|l| l.iter().rev().take(20).rev().cloned().collect())
                .unwrap_or_default();
            match b["state"].as_str() {
                Some("succeeded") => {
                    return Ok(
                        json!({"template": brief(&b["template"]), "build_id": id, "log_tail": tail}),
                    )
                }
                Some("failed") => {
                    let lines: Vec<&str> = tail.iter().filter_map(Value::as_str).collect();
                    return Err(Fail(format!(
                        "template build {id} failed: {}\nlast log lines:\n{}",
                        b["error"].as_str().unwrap_or("no reason given"),
                        lines.join("\n")
                    )));
                }
                _ => {}
            }
            if Instant::now() >= until {
                return Err(Fail(format!(
                    "template build {id} is still {} after {} s: call template_list later to see whether it appeared",
                    b["state"].as_str().unwrap_or("running"),
                    timeout.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}
