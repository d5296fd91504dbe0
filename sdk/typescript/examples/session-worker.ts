// A tool worker for hosted agent loops (Claude Managed Agents' custom tools, an OpenAI Agents
// API session, any loop that runs at the vendor and sends its tool calls out): each session
// gets its own Locker sandbox, kept across calls and worker restarts (SessionSandboxes finds
// it again by its metadata), deleted when the session ends.
//
// The worker is an HTTP endpoint the vendor's side (or a relay of its events) calls:
//   POST /tool-call   {"session_id", "id", "name": "bash" | "str_replace_based_edit_tool", "input"}
//                     → {"type": "tool_result", "tool_use_id", "content", "is_error"?}
//   POST /session-end {"session_id"} → 204, the session's sandbox deleted
//
//   LOCKER_URL=… LOCKER_API_KEY=… node build/examples/session-worker.js [port]
//   LOCKER_URL=… LOCKER_API_KEY=… node build/examples/session-worker.js --offline
//
// `--offline` starts the worker on a free port and plays the vendor's side: two sessions
// whose calls interleave, each seeing only its own sandbox's files and shell state.
import { createServer, type IncomingMessage } from "node:http";
import type { AddressInfo } from "node:net";
import { SessionSandboxes } from "locker-sandbox";
import { AnthropicTools } from "locker-sandbox/anthropic";

const sandboxes = new SessionSandboxes({ network: { internet: false }, metadata: { example: "session-worker" } });
const tools = new Map<string, AnthropicTools>();

async function body(req: IncomingMessage): Promise<Record<string, any>> {
  let s = "";
  for await (const c of req) s += c;
  return JSON.parse(s || "{}");
}

const server = createServer(async (req, res) => {
  const send = (status: number, v?: unknown) => {
    res.writeHead(status, { "content-type": "application/json" });
    res.end(v === undefined ? "" : JSON.stringify(v));
  };
  try {
    const b = await body(req);
    const session = String(b["session_id"] ?? "");
    if (!session) return send(400, { error: "session_id is required" });
    if (req.method === "POST" && req.url === "/tool-call") {
      let t = tools.get(session);
      if (!t) tools.set(session, (t = new AnthropicTools(await sandboxes.get(session))));
      return send(200, await t.call({ type: "tool_use", id: String(b["id"]), name: String(b["name"]), input: b["input"] }));
    }
    if (req.method === "POST" && req.url === "/session-end") {
      tools.delete(session);
      await sandboxes.end(session);
      return send(204);
    }
    send(404, { error: `${req.method} ${req.url}: POST /tool-call or /session-end` });
  } catch (e) {
    send(500, { error: String(e) });
  }
});

const offline = process.argv.includes("--offline");
const port = offline ? 0 : Number(process.argv[2] ?? 8787);
await new Promise<void>((ok) => server.listen(port, "127.0.0.1", ok));
const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
console.log(`tool worker at ${url}`);

if (offline) {
  // The vendor's side: two sessions, their calls interleaved.
  const call = async (session: string, name: string, input: unknown) => {
    const r = await fetch(`${url}/tool-call`, { method: "POST", body: JSON.stringify({ session_id: session, id: `toolu_${Math.random().toString(36).slice(2)}`, name, input }) });
    const out = (await r.json()) as { content: string; is_error?: boolean };
    console.log(`[${session}] ${name}: ${JSON.stringify(out.content)}${out.is_error ? " (error)" : ""}`);
  };
  await call("sess-a", "bash", { command: "cd /tmp && export OWNER=a && echo a > /workspace/who.txt" });
  await call("sess-b", "bash", { command: "export OWNER=b && echo b > /workspace/who.txt" });
  await call("sess-a", "bash", { command: "pwd; echo $OWNER; cat /workspace/who.txt" });
  await call("sess-b", "str_replace_based_edit_tool", { command: "view", path: "/workspace/who.txt" });
  for (const s of ["sess-a", "sess-b"]) await fetch(`${url}/session-end`, { method: "POST", body: JSON.stringify({ session_id: s }) });
  console.log("sessions ended");
  server.close();
}
