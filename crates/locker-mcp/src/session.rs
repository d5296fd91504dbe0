//! Carries out the session-management tools of `tools_session.rs`: sandbox_list,
//! sandbox_set_ttl, process_list, snapshot_list, snapshot_delete.
//!
//! Each is one or two calls of Locker's public API through the same [`Call`] as the other
//! tools (same key, same error policy); the answers are trimmed to what a model needs to
//! recognise a thing and act on it. Must not reach the server any other way.

use http::Method;
use serde_json::{json, Map, Value};

use crate::server::{enc, seg, Call, Fail, Out};

/// The fields of a Sandbox that sandbox_list keeps.
const SANDBOX_BRIEF: &[&str] = &[
    "id",
    "state",
    "template",
    "runtime",
    "network",
    "created_at",
    "expires_at",
    "last_active_at",
    "metadata",
];

fn keep(v: &Value, fields: &[&str]) -> Value {
    let m: Map<String, Value> = fields
        .iter()
        .filter_map(|f| v.get(*f).map(|x| ((*f).to_owned(), x.clone())))
        .collect();
    Value::Object(m)
}

impl Call<'_> {
    pub(crate) async fn sandbox_list(&self) -> Out {
        let mut q = Vec::new();
        if let Some(s) = self.str("state") {
            q.push(format!("state={}", enc(s)));
        }
        if let Some(m) = self.args.get("metadata").and_then(Value::as_object) {
            for (k, v) in m {
                let v = v
                    .as_str()
                    .ok_or_else(|| Fail(format!("metadata filter `{k}` must be a string")))?;
                q.push(format!("metadata.{}={}", enc(k), enc(v)));
            }
        }
        let path = if q.is_empty() {
            "/v1/sandboxes".to_owned()
        } else {
            format!("/v1/sandboxes?{}", q.join("&"))
        };
        let v = self.json(Method::GET, path, None).await?;
        let list: Vec<Value> = v["sandboxes"]
            .as_array()
            .map(|a| a.iter().map(|s| keep(s, SANDBOX_BRIEF)).collect())
            .unwrap_or_default();
        Ok(json!({ "sandboxes": list }))
    }

    pub(crate) async fn sandbox_set_ttl(&self) -> Out {
        let sb = seg(self.need("sandbox_id")?)?.to_owned();
        let ttl = self
            .u64("ttl_s")?
            .ok_or_else(|| Fail("`ttl_s` is required: seconds from now".into()))?;
        self.json(
            Method::POST,
            format!("/v1/sandboxes/{sb}/ttl"),
            Some(json!({ "ttl_s": ttl })),
        )
        .await
    }

    pub(crate) async fn process_list(&self) -> Out {
        let sb = seg(self.need("sandbox_id")?)?.to_owned();
        let v = self
            .json(Method::GET, format!("/v1/sandboxes/{sb}/processes"), None)
            .await?;
        let list: Vec<Value> = v["processes"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|p| {
                        let mut result = p.get("result").cloned().unwrap_or(Value::Null);
                        if let Some(r) = result.as_object_mut() {
                            // The bodies belong to process_output; keep the list small.
                            for f in ["stdout", "stderr", "stdout_b64", "stderr_b64"] {
                                r.remove(f);
                            }
                        }
                        json!({
                            "process_id": p["id"], "pid": p["pid"], "argv": p["argv"],
                            "state": p["state"], "started_at": p["started_at"],
                            "result": result,
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(json!({ "processes": list }))
    }

    pub(crate) async fn snapshot_list(&self) -> Out {
        let only = self.str("sandbox_id");
        let v = self
            .json(Method::GET, "/v1/snapshots".to_owned(), None)
            .await?;
        let list: Vec<Value> = v["snapshots"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|s| only.is_none_or(|id| s["sandbox_id"] == id))
                    .map(|s| {
                        keep(
                            s,
                            &[
                                "id",
                                "sandbox_id",
                                "template",
                                "runtime",
                                "size_bytes",
                                "has_memory",
                                "created_at",
                            ],
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(json!({ "snapshots": list }))
    }

    pub(crate) async fn snapshot_delete(&self) -> Out {
        let id = seg(self.need("snapshot_id")?)?.to_owned();
        let deleted = self.delete(format!("/v1/snapshots/{id}")).await?;
        Ok(json!({ "snapshot_id": id, "deleted": deleted }))
    }
}
