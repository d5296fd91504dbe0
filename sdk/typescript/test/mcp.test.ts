// MCP servers in a sandbox: mcpServer() starts a stdio server in the machine and gives what
// an MCP client needs (url, headers); the server answers Streamable HTTP there; the list
// shows it; stop() (or `await using`) ends it; bad servers are refused with what to fix.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { BadGateway, BadRequest, Conflict, McpServer, NotFound, type Sandbox } from "locker-sandbox";
import { client, unique } from "./helpers.js";

const c = client();
let sbx: Sandbox;

before(async () => {
  sbx = await c.sandboxes.create({ metadata: { suite: unique("mcp") } });
  await sbx.files.write("/root/echo.py", ECHO);
});
after(async () => {
  await sbx?.delete().catch(() => undefined);
});

// A minimal stdio MCP server: initialize, tools/list, tools/call of `echo`.
const ECHO = `
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if "id" not in m:
        continue
    if m["method"] == "initialize":
        r = {"protocolVersion": m["params"]["protocolVersion"], "capabilities": {"tools": {}},
             "serverInfo": {"name": "echo", "version": "1"}}
    elif m["method"] == "tools/list":
        r = {"tools": [{"name": "echo", "inputSchema": {"type": "object"}}]}
    elif m["method"] == "tools/call":
        r = {"content": [{"type": "text", "text": m["params"]["arguments"]["text"] + " " + __import__("os").environ.get("X", "")}]}
    else:
        r = {}
    print(json.dumps({"jsonrpc": "2.0", "id": m["id"], "result": r}), flush=True)
`;

/** One JSON-RPC message to the bridged server: its answer (JSON or SSE) and the session id. */
async function post(srv: McpServer, body: unknown, session?: string): Promise<{ msg: any; sid: string | null; status: number }> {
  const headers: Record<string, string> = {
    ...srv.headers,
    "Content-Type": "application/json",
    Accept: "application/json, text/event-stream",
  };
  if (session) headers["Mcp-Session-Id"] = session;
  const res = await fetch(srv.url, { method: "POST", headers, body: JSON.stringify(body) });
  const raw = await res.text();
  if (res.status >= 400) return { msg: raw, sid: null, status: res.status };
  const data = raw.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).filter(Boolean);
  return { msg: JSON.parse(data.length ? data[data.length - 1]! : raw), sid: res.headers.get("mcp-session-id"), status: res.status };
}

test("an MCP server in a sandbox is reached with its url and headers, listed, and stopped", async () => {
  let url: string;
  {
    await using srv = await sbx.mcpServer("echo", ["python3", "/root/echo.py"], { env: { X: "from-env" }, cwd: "/root" });
    assert.ok(srv instanceof McpServer);
    assert.equal(srv.state, "running", JSON.stringify(srv.info));
    assert.deepEqual(srv.info.cmd, ["python3", "/root/echo.py"]);
    assert.match(String(srv.info.processId), /^proc_/);
    assert.equal(srv.url, `${c.url}/v1/sandboxes/${sbx.id}/mcp/echo`);
    assert.match(srv.headers["Authorization"]!, /^Bearer /);
    url = srv.url;
    const init = await post(srv, {
      jsonrpc: "2.0",
      id: 1,
      method: "initialize",
      params: { protocolVersion: "2025-11-25", capabilities: {}, clientInfo: { name: "ts-sdk-test", version: "1" } },
    });
    assert.equal(init.msg.result.serverInfo.name, "echo", JSON.stringify(init.msg));
    assert.ok(init.sid, "a session id");
    const out = await post(srv, { jsonrpc: "2.0", id: 2, method: "tools/call", params: { name: "echo", arguments: { text: "hi over MCP" } } }, init.sid!);
    assert.equal(out.msg.result.content[0].text, "hi over MCP from-env", JSON.stringify(out.msg));
    const listed = await sbx.mcpServers();
    assert.deepEqual(listed.map((s) => s.name), ["echo"]);
    assert.equal((await srv.refresh()).state, "running");
    await assert.rejects(sbx.mcpServer("echo", ["python3", "/root/echo.py"]), Conflict, "a name that runs already");
  }
  // `await using` stopped it: gone from the list, its endpoint 404.
  assert.deepEqual(await sbx.mcpServers(), []);
  const res = await fetch(url, {
    method: "POST",
    headers: { Authorization: `Bearer ${process.env.LOCKER_API_KEY}`, "Content-Type": "application/json", Accept: "application/json, text/event-stream" },
    body: JSON.stringify({ jsonrpc: "2.0", id: 3, method: "ping" }),
  });
  assert.equal(res.status, 404);
  await res.body?.cancel();
});

test("bad MCP servers are refused with what to fix", async () => {
  const bad = await sbx.mcpServer("Not OK", ["python3"]).catch((e: unknown) => e);
  assert.ok(bad instanceof BadRequest, String(bad));
  assert.match(bad.message, /a-z/);
  const quits = await sbx.mcpServer("quits", ["sh", "-c", "echo gone >&2; exit 4"]).catch((e: unknown) => e);
  assert.ok(quits instanceof BadGateway, String(quits));
  assert.match(quits.message, /exit code 4/);
  assert.match(quits.message, /gone/);
  await assert.rejects(sbx.mcpServer("empty", []), TypeError);
  const srv = await sbx.mcpServer("brief", ["python3", "/root/echo.py"]);
  await srv.stop();
  await assert.rejects(srv.refresh(), NotFound);
  await assert.rejects(srv.stop(), NotFound);
});
