// docs/sdks.md's parity table (every API operation × CLI × Python × TypeScript × MCP) is
// true: each operation of the running server's /openapi.json has one row and no row is
// stale; each cell names something that exists — a CLI command (`locker … --help` answers,
// flags included), a Python method (`Class.method` in sdk/python/src/locker), a TypeScript
// method of this package, an MCP tool of the server's `tools/list` — or says why not; and
// the TypeScript column agrees with test/operations.ts.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { readFile, readdir } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { OPERATIONS, exists } from "./operations.js";
import { client } from "./helpers.js";

const repo = fileURLToPath(new URL("../../../../", import.meta.url));

/** The table's rows: operation → [cli, python, typescript, mcp] cells. */
async function table(): Promise<Map<string, string[]>> {
  const doc = await readFile(`${repo}docs/sdks.md`, "utf8");
  const start = doc.indexOf("<!-- parity-table:start -->");
  const end = doc.indexOf("<!-- parity-table:end -->");
  assert.ok(start >= 0 && end > start, "docs/sdks.md has the parity table between its markers");
  const rows = new Map<string, string[]>();
  for (const line of doc.slice(start, end).split("\n")) {
    const m = /^\| `([A-Z]+ [^`]+)` \|(.*)\|$/.exec(line.trim());
    if (!m) continue;
    const cells = m[2]!.split(" | ").map((c) => c.trim());
    assert.equal(cells.length, 4, `four clients in the row of ${m[1]}: ${line}`);
    assert.ok(!rows.has(m[1]!), `one row for ${m[1]}`);
    rows.set(m[1]!, cells);
  }
  return rows;
}

/** A covered cell's name, or null for a reason ("— why"); an empty cell fails. */
function named(op: string, client: string, cell: string): string | null {
  assert.ok(cell.length > 0, `${op}: the ${client} cell is empty`);
  if (cell.startsWith("—")) {
    assert.ok(cell.replace(/^—\s*/, "").length > 3, `${op}: the ${client} cell gives no reason: ${cell}`);
    return null;
  }
  const m = /^`([^`]+)`$/.exec(cell);
  assert.ok(m, `${op}: the ${client} cell is one \`name\` or "— reason": ${cell}`);
  return m[1]!;
}

/** Python classes and their methods, from the SDK's sources. */
async function pythonMethods(): Promise<Map<string, Set<string>>> {
  const dir = `${repo}sdk/python/src/locker`;
  const out = new Map<string, Set<string>>();
  for (const f of (await readdir(dir)).filter((f) => f.endsWith(".py"))) {
    const src = await readFile(`${dir}/${f}`, "utf8");
    for (const part of src.split(/^(?=class )/m)) {
      const cls = /^class (\w+)/.exec(part)?.[1];
      if (!cls) continue;
      const defs = out.get(cls) ?? new Set<string>();
      for (const d of part.matchAll(/^ {4}def (\w+)\(/gm)) defs.add(d[1]!);
      out.set(cls, defs);
    }
  }
  return out;
}

/** The MCP server's tool names. */
async function mcpTools(): Promise<Set<string>> {
  const c = client();
  const meta = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientInfo": { name: "sdks-table", version: "1" },
    "io.modelcontextprotocol/clientCapabilities": {},
  };
  const res = await fetch(`${c.url}/mcp`, {
    method: "POST",
    headers: {
      Authorization: `Bearer ${process.env.LOCKER_API_KEY}`,
      "Content-Type": "application/json",
      Accept: "application/json, text/event-stream",
      "MCP-Protocol-Version": "2026-07-28",
      "Mcp-Method": "tools/list",
    },
    body: JSON.stringify({ jsonrpc: "2.0", id: 1, method: "tools/list", params: { _meta: meta } }),
  });
  const text = await res.text();
  const json = text.split("\n").find((l) => l.startsWith("data: "))?.slice(6) ?? text;
  const tools = (JSON.parse(json) as { result: { tools: { name: string }[] } }).result.tools.map((t) => t.name);
  assert.ok(tools.length > 10, `the MCP server lists its tools: ${text.slice(0, 500)}`);
  return new Set(tools);
}

test("docs/sdks.md's parity table is true for every operation and client", async () => {
  const bin = process.env.LOCKER_BIN;
  assert.ok(bin, "LOCKER_BIN names the locker binary (tests/typescript_sdk.rs sets it)");
  const doc = (await (await fetch(`${client().url}/openapi.json`)).json()) as { paths: Record<string, Record<string, unknown>> };
  const served = Object.entries(doc.paths).flatMap(([p, ops]) =>
    Object.keys(ops).filter((m) => ["get", "post", "put", "patch", "delete"].includes(m)).map((m) => `${m.toUpperCase()} ${p}`),
  );
  const rows = await table();
  assert.deepEqual(served.filter((op) => !rows.has(op)), [], "operations the server serves that the table has no row for");
  assert.deepEqual([...rows.keys()].filter((op) => !served.includes(op)), [], "rows for operations the server no longer serves");

  const py = await pythonMethods();
  const tools = await mcpTools();
  const helped = new Map<string, Promise<string>>();
  const help = (words: string[]) => {
    const key = words.join(" ");
    if (!helped.has(key)) {
      helped.set(key, promisify(execFile)(bin!, [...words, "--help"], { timeout: 30_000 }).then((r) => r.stdout, (e: unknown) => `FAILED: ${String(e)}`));
    }
    return helped.get(key)!;
  };
  for (const [op, [cli, python, ts, mcp]] of rows) {
    const command = named(op, "CLI", cli!);
    if (command) {
      const words = command.split(/\s+/);
      assert.equal(words[0], "locker", `${op}: a CLI cell is a locker command: ${command}`);
      const sub = words.slice(1).filter((w) => !w.startsWith("-"));
      const out = await help(sub);
      assert.doesNotMatch(out, /^FAILED/, `${op}: \`${command}\` is not a command of the CLI: ${out}`);
      for (const flag of words.filter((w) => w.startsWith("--"))) assert.ok(out.includes(flag), `${op}: \`locker ${sub.join(" ")}\` has no ${flag}`);
    }
    const method = named(op, "Python", python!);
    if (method) {
      const [cls, name] = method.split(".");
      assert.ok(py.get(cls!)?.has(name!), `${op}: the Python SDK has no ${method}`);
    }
    const tsName = named(op, "TypeScript", ts!);
    if (tsName) assert.ok(exists(tsName), `${op}: the TypeScript SDK has no ${tsName}`);
    const covered = OPERATIONS[op];
    assert.ok(covered, `${op} is in test/operations.ts`);
    assert.equal(Boolean(tsName), "by" in covered, `${op}: docs/sdks.md and test/operations.ts agree on whether the TypeScript SDK covers it`);
    if (tsName && "by" in covered) assert.equal(tsName, covered.by, `${op}: the same TypeScript method in both`);
    const tool = named(op, "MCP", mcp!);
    if (tool) assert.ok(tools.has(tool), `${op}: the MCP server has no tool ${tool} (it has ${[...tools].join(", ")})`);
  }
});
