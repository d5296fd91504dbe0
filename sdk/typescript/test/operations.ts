// Shared by the parity tests: the operations this package covers (or why not), and whether
// a reference names a function of the package.
import * as sdk from "locker-sandbox";

export type Covered = { by: string } | { not: string };

/** "METHOD /path" → the class and method that call it, or why none does. */
export const OPERATIONS: Record<string, Covered> = {
  "GET /healthz": { by: "Client#health" },
  "GET /openapi.json": { not: "the API's description itself; this package is its client" },
  "GET /metrics": { not: "Prometheus text for a scraper, not for applications" },
  "GET /ui": { not: "the dashboard, for a browser" },
  "GET /mcp": { not: "the MCP server, for MCP clients" },
  "POST /mcp": { not: "the MCP server, for MCP clients" },
  "DELETE /mcp": { not: "the MCP server, for MCP clients" },
  "POST /v1/tenants": { not: "admin key only: `locker tenant create`" },
  "POST /v1/tenants/{name}/keys": { not: "admin key only: `locker key create`" },
  "DELETE /v1/keys/{key_id}": { not: "admin key only: `locker key revoke`" },
  "POST /v1/fleet/tokens": { not: "admin key only: `locker fleet token`" },
  "GET /v1/fleet/nodes": { not: "admin key only: `locker fleet nodes`" },
  "DELETE /v1/fleet/nodes/{node}": { not: "admin key only: `locker fleet remove`" },
  "POST /v1/fleet/nodes/{node}/cordon": { not: "admin key only: `locker fleet cordon`" },
  "POST /v1/fleet/nodes/{node}/uncordon": { not: "admin key only: `locker fleet uncordon`" },
  "POST /v1/fleet/nodes/{node}/drain": { not: "admin key only: `locker fleet drain`" },
  "GET /v1/calls": { by: "Client#calls" },
  "GET /v1/usage": { by: "Client#usage" },
  "GET /v1/usage/series": { not: "the dashboard's usage charts; applications read totals with Client#usage" },
  "GET /v1/events": { not: "an event stream for dashboards and operators: `locker events`, the dashboard" },
  "POST /v1/webhooks": { not: "webhooks are registered once by an operator (curl, docs/api.md), like keys" },
  "GET /v1/webhooks": { not: "webhooks are registered once by an operator (curl, docs/api.md), like keys" },
  "DELETE /v1/webhooks/{id}": { not: "webhooks are registered once by an operator (curl, docs/api.md), like keys" },
  "GET /v1/templates": { by: "Templates#list" },
  "DELETE /v1/templates/{name}": { by: "Templates#delete" },
  "POST /v1/templates": { by: "Templates#build" },
  "GET /v1/templates/builds/{id}": { by: "Templates#buildStatus" },
  "POST /v1/templates/contexts": { by: "Templates#uploadContext" },
  "GET /v1/templates/{name}": { by: "Templates#get" },
  "PUT /v1/templates/{name}/image": { by: "Templates#importImage" },
  "GET /v1/templates/builds": { not: "the dashboard's list of a tenant's recent builds; an application follows its own build (Templates#build)" },
  "GET /v1/sandboxes": { by: "Sandbox.list" },
  "POST /v1/sandboxes": { by: "Sandbox.create" },
  "GET /v1/sandboxes/{id}": { by: "Sandbox.get" },
  "PATCH /v1/sandboxes/{id}": { by: "Sandbox#update" },
  "DELETE /v1/sandboxes/{id}": { by: "Sandbox#delete" },
  "POST /v1/sandboxes/{id}/exec": { by: "Sandbox#exec" },
  "POST /v1/sandboxes/{id}/ttl": { by: "Sandbox#setTtl" },
  "POST /v1/sandboxes/{id}/pause": { by: "Sandbox#pause" },
  "POST /v1/sandboxes/{id}/resume": { by: "Sandbox#resume" },
  "POST /v1/sandboxes/{id}/snapshots": { by: "Sandbox#snapshot" },
  "POST /v1/sandboxes/{id}/fork": { by: "Sandbox#fork" },
  "GET /v1/sandboxes/{id}/ports": { by: "Sandbox#ports" },
  "PUT /v1/sandboxes/{id}/ports/{port}": { by: "Sandbox#expose" },
  "GET /v1/sandboxes/{id}/ports/{port}/{path}": { by: "Sandbox#url" },
  "POST /v1/sandboxes/{id}/preview-token": { by: "Sandbox#rotatePreviewToken" },
  "GET /v1/sandboxes/{id}/pty": { by: "Sandbox#pty" },
  "POST /v1/sandboxes/{id}/pty/ticket": { not: "for a browser's terminal, which cannot send a header on a WebSocket; this package sends its key" },
  "GET /v1/sandboxes/{id}/processes": { by: "Processes#list" },
  "POST /v1/sandboxes/{id}/processes": { by: "Processes#start" },
  "GET /v1/sandboxes/{id}/processes/{proc}": { by: "Process#info" },
  "GET /v1/sandboxes/{id}/processes/{proc}/output": { by: "Process#output" },
  "POST /v1/sandboxes/{id}/processes/{proc}/signal": { by: "Process#signal" },
  "POST /v1/sandboxes/{id}/processes/{proc}/stdin": { by: "Process#writeStdin" },
  "GET /v1/snapshots": { by: "Client.snapshots.list" },
  "DELETE /v1/snapshots/{id}": { by: "Client.snapshots.delete" },
  "POST /v1/secrets": { by: "Secrets#create" },
  "GET /v1/secrets": { by: "Secrets#list" },
  "GET /v1/secrets/{name}": { by: "Secrets#get" },
  "PUT /v1/secrets/{name}": { by: "Secrets#rotate" },
  "DELETE /v1/secrets/{name}": { by: "Secrets#delete" },
  "GET /v1/volumes": { by: "Volumes#list" },
  "POST /v1/volumes": { by: "Volumes#create" },
  "GET /v1/volumes/{id}": { by: "Volumes#get" },
  "DELETE /v1/volumes/{id}": { by: "Volume#delete" },
  "POST /v1/volumes/{id}/run": { by: "Volume#run" },
  "GET /v1/volumes/{id}/snapshots": { by: "Volume#snapshots" },
  "POST /v1/volumes/{id}/snapshots": { by: "Volume#snapshot" },
  "DELETE /v1/volumes/{id}/snapshots/{snap}": { by: "Volume#deleteSnapshot" },
  "POST /v1/volumes/{id}/restore": { by: "Volume#restore" },
  "POST /v1/volumes/{id}/fork": { by: "Volume#fork" },
  "POST /v1/volumes/{id}/move": { by: "Volume#move" },
  "POST /v1/sandboxes/{id}/contexts": { by: "Sandbox#createCodeContext" },
  "GET /v1/sandboxes/{id}/contexts": { by: "Sandbox#codeContexts" },
  "DELETE /v1/sandboxes/{id}/contexts/{ctx}": { by: "CodeContext#delete" },
  "POST /v1/sandboxes/{id}/contexts/{ctx}/restart": { by: "CodeContext#restart" },
  "POST /v1/sandboxes/{id}/contexts/{ctx}/interrupt": { by: "CodeContext#interrupt" },
  "POST /v1/sandboxes/{id}/code": { by: "Sandbox#runCode" },
  "POST /v1/sandboxes/{id}/mcp": { by: "Sandbox#mcpServer" },
  "GET /v1/sandboxes/{id}/mcp": { by: "Sandbox#mcpServers" },
  "POST /v1/sandboxes/{id}/mcp/{name}": { not: "a bridged MCP server's Streamable HTTP endpoint, for MCP clients (McpServer#url and #headers say how to reach it)" },
  "GET /v1/sandboxes/{id}/mcp/{name}": { not: "a bridged MCP server's Streamable HTTP endpoint, for MCP clients (McpServer#url and #headers say how to reach it)" },
  "DELETE /v1/sandboxes/{id}/mcp/{name}": { by: "McpServer#stop" },
};
for (const owner of ["sandboxes", "volumes"]) {
  Object.assign(OPERATIONS, {
    [`GET /v1/${owner}/{id}/files`]: { by: "Files#read" },
    [`PUT /v1/${owner}/{id}/files`]: { by: "Files#write" },
    [`DELETE /v1/${owner}/{id}/files`]: { by: "Files#remove" },
    [`GET /v1/${owner}/{id}/files/list`]: { by: "Files#list" },
    [`GET /v1/${owner}/{id}/files/stat`]: { by: "Files#stat" },
    [`POST /v1/${owner}/{id}/files/mkdir`]: { by: "Files#mkdir" },
    [`POST /v1/${owner}/{id}/files/move`]: { by: "Files#move" },
  });
}

/** Whether `ref` ("Class#method", "Class.static", "Client.group.method") names a function of the package. */
export function exists(ref: string): boolean {
  const exports = sdk as unknown as Record<string, { prototype?: Record<string, unknown> } & Record<string, unknown>>;
  const [cls, rest] = ref.includes("#") ? ref.split("#") : [ref.slice(0, ref.indexOf(".")), undefined];
  const C = exports[cls!];
  if (!C) return false;
  if (rest !== undefined) {
    let proto = C.prototype;
    while (proto) {
      if (typeof Object.getOwnPropertyDescriptor(proto, rest)?.value === "function") return true;
      proto = Object.getPrototypeOf(proto);
    }
    return false;
  }
  const path = ref.split(".").slice(1);
  if (path.length === 1) return typeof C[path[0]!] === "function";
  // An instance's group (client.snapshots.list): look at a client that is never used to call.
  const inst = new sdk.Client({ url: "http://127.0.0.1:1" }) as unknown as Record<string, Record<string, unknown>>;
  return typeof inst[path[0]!]?.[path[1]!] === "function";
}

