//! One MCP session on a bridged server: rmcp's Streamable HTTP side calls this handler,
//! which forwards each request to the shared stdio process ([`Upstream`]).
//!
//! Owns the mapping between rmcp's typed requests and the process's JSON-RPC: `initialize`
//! and `server/discover` are answered from the process's own `initialize` answer (the
//! process is initialized once, by the bridge); every other request is forwarded with its
//! `_meta` (minus the transport's own keys) and its answer parsed back. Must not touch the
//! process's link (that is `upstream.rs`) nor HTTP routing (`mod.rs`).

use std::sync::Arc;

use locker_mcp::rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CompleteRequestParams, CompleteResult,
    CustomRequest, CustomResult, ErrorData, GetPromptRequestParams, GetPromptResponse,
    GetPromptResult, InitializeRequestParams, InitializeResult, ListPromptsResult,
    ListResourceTemplatesResult, ListResourcesResult, ListToolsResult, PaginatedRequestParams,
    ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult, RequestMetaObject,
    ServerConfig, SubscribeRequestParams, UnsubscribeRequestParams,
};
use locker_mcp::rmcp::service::{RequestContext, RoleServer};
use locker_mcp::rmcp::ServerHandler;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::upstream::{bridge_error, Upstream};

/// The handler of one session (rmcp makes one per session from the bridge's factory).
#[derive(Clone)]
pub struct BridgeSession {
    pub up: Arc<Upstream>,
}

/// `_meta` keys of the HTTP transport's own lifecycle, which the stdio process must not see.
const TRANSPORT_META: &str = "io.modelcontextprotocol/";

impl BridgeSession {
    /// Forwards `method` with `params` and the request's `_meta`; parses the answer as `R`.
    async fn forward<P: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        params: Option<P>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<R, ErrorData> {
        let mut p = match params {
            Some(p) => serde_json::to_value(p)
                .map_err(|e| bridge_error(format!("cannot forward {method}: {e}")))?,
            None => Value::Object(Default::default()),
        };
        let meta = meta_for_process(&ctx.meta);
        if let (Some(obj), false) = (p.as_object_mut(), meta.is_empty()) {
            obj.insert("_meta".into(), Value::Object(meta));
        }
        let params = match &p {
            Value::Object(m) if m.is_empty() => None,
            _ => Some(p),
        };
        let mut v = self
            .up
            .request(method, params, Some(ctx.peer.clone()), &ctx.ct)
            .await?;
        // The process speaks a session-based revision, where every answer is complete; the
        // current revision says so in `resultType` (rmcp drops it again for older clients).
        if let Some(m) = v.as_object_mut() {
            m.entry("resultType").or_insert_with(|| "complete".into());
        }
        serde_json::from_value(v).map_err(|e| {
            bridge_error(format!(
                "the MCP server's answer to {method} is malformed: {e}"
            ))
        })
    }
}

fn meta_for_process(meta: &RequestMetaObject) -> serde_json::Map<String, Value> {
    meta.0
         .0
        .iter()
        .filter(|(k, _)| !k.starts_with(TRANSPORT_META))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

impl ServerHandler for BridgeSession {
    fn get_info(&self) -> ServerConfig {
        // The bridge registers a server only after its `initialize` answered.
        self.up.info().cloned().unwrap_or_default()
    }

    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, ErrorData> {
        context.peer.set_peer_info(request.clone());
        // This session now receives the server's notifications on its GET stream.
        self.up.add_peer(context.peer.clone());
        self.negotiate_initialize(&request)
    }

    async fn ping(&self, context: RequestContext<RoleServer>) -> Result<(), ErrorData> {
        let _: Value = self.forward::<Value, _>("ping", None, context).await?;
        Ok(())
    }

    async fn complete(
        &self,
        request: CompleteRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, ErrorData> {
        self.forward("completion/complete", Some(request), context)
            .await
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        let r: GetPromptResult = self.forward("prompts/get", Some(request), context).await?;
        Ok(r.into())
    }

    async fn list_prompts(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        self.forward("prompts/list", request, context).await
    }

    async fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        self.forward("resources/list", request, context).await
    }

    async fn list_resource_templates(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        self.forward("resources/templates/list", request, context)
            .await
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let r: ReadResourceResult = self
            .forward("resources/read", Some(request), context)
            .await?;
        Ok(r.into())
    }

    async fn subscribe(
        &self,
        request: SubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let _: Value = self
            .forward("resources/subscribe", Some(request), context)
            .await?;
        Ok(())
    }

    async fn unsubscribe(
        &self,
        request: UnsubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let _: Value = self
            .forward("resources/unsubscribe", Some(request), context)
            .await?;
        Ok(())
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let r: CallToolResult = self.forward("tools/call", Some(request), context).await?;
        Ok(r.into())
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        self.forward("tools/list", request, context).await
    }

    async fn on_custom_request(
        &self,
        request: CustomRequest,
        context: RequestContext<RoleServer>,
    ) -> Result<CustomResult, ErrorData> {
        let method = request.method.clone();
        let v: Value = self.forward(&method, request.params, context).await?;
        Ok(CustomResult(v))
    }
}
