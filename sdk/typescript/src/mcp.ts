/**
 * MCP servers in a sandbox: a stdio server started in the machine and served by Locker as
 * Streamable HTTP (`POST /v1/sandboxes/{id}/mcp`), so any MCP client reaches it at `url`
 * with `headers`. Owns `/v1/sandboxes/{id}/mcp…` but the endpoint itself, which is for MCP
 * clients (this package speaks no MCP).
 */

import { seg, type Transport } from "./transport.js";
import { NotFound } from "./errors.js";
import { asyncDispose } from "./dispose.js";

export interface McpServerOptions {
  /** Added to the sandbox's environment. */
  env?: Record<string, string>;
  /** Its working directory (default /root). */
  cwd?: string;
  /** How long one request may wait for its answer (default 300, 1 to 3600). */
  requestTimeoutS?: number;
  signal?: AbortSignal;
}

/** An MCP server as the server describes it. */
export interface McpServerInfo {
  name: string;
  /** "running" or "exited". */
  state: string;
  cmd: string[];
  processId?: string;
  pid?: number;
  startedAt?: string;
  /** The server's `serverInfo` from its `initialize` answer. */
  serverInfo?: Record<string, unknown> | null;
  droppedLines?: number;
  /** Why it exited: its exit code and the end of its stderr. */
  error?: string | null;
  [more: string]: unknown;
}

function serverInfo(w: Record<string, unknown>): McpServerInfo {
  return {
    ...w,
    name: String(w["name"]),
    state: String(w["state"] ?? ""),
    cmd: (w["cmd"] as string[]) ?? [],
    processId: w["process_id"] as string | undefined,
    pid: w["pid"] as number | undefined,
    startedAt: w["started_at"] as string | undefined,
    serverInfo: (w["server_info"] as Record<string, unknown> | null | undefined) ?? null,
    droppedLines: w["dropped_lines"] as number | undefined,
    error: (w["error"] as string | null | undefined) ?? null,
  };
}

/** An MCP server running in a sandbox. */
export class McpServer {
  readonly name: string;
  /** What the server said about it last (`refresh()` asks again). */
  info: McpServerInfo;

  /** @internal */
  constructor(
    private readonly t: Transport,
    readonly sandboxId: string,
    wire: Record<string, unknown>,
  ) {
    this.info = serverInfo(wire);
    this.name = this.info.name;
  }

  /** @internal A name the server refuses (not `[a-z0-9_-]{1,64}`) is its BadRequest. */
  static async start(t: Transport, sandboxId: string, name: string, cmd: readonly string[], opts: McpServerOptions = {}): Promise<McpServer> {
    if (!Array.isArray(cmd) || cmd.length === 0 || !cmd.every((a) => typeof a === "string")) {
      throw new TypeError("an MCP server's cmd is a non-empty list of strings (the program and its arguments)");
    }
    const body: Record<string, unknown> = { name, cmd: [...cmd] };
    if (opts.env !== undefined) body["env"] = opts.env;
    if (opts.cwd !== undefined) body["cwd"] = opts.cwd;
    if (opts.requestTimeoutS !== undefined) body["request_timeout_s"] = opts.requestTimeoutS;
    const wire = await t.json<Record<string, unknown>>("POST", `/v1/sandboxes/${seg(sandboxId)}/mcp`, { body, signal: opts.signal });
    return new McpServer(t, sandboxId, wire);
  }

  /** @internal */
  static async list(t: Transport, sandboxId: string): Promise<McpServer[]> {
    const d = await t.json<{ servers: Record<string, unknown>[] }>("GET", `/v1/sandboxes/${seg(sandboxId)}/mcp`);
    return (d.servers ?? []).map((w) => new McpServer(t, sandboxId, w));
  }

  get state(): string {
    return this.info.state;
  }

  /** Its Streamable HTTP endpoint, as this client reaches Locker. */
  get url(): string {
    return `${this.t.url}/v1/sandboxes/${seg(this.sandboxId)}/mcp/${seg(this.name)}`;
  }

  /** What an MCP client must send with every request (the API key). */
  get headers(): Record<string, string> {
    return this.t.apiKey ? { Authorization: `Bearer ${this.t.apiKey}` } : {};
  }

  /** Asks for its state now (NotFound once it was stopped). */
  async refresh(): Promise<McpServerInfo> {
    const found = (await McpServer.list(this.t, this.sandboxId)).find((s) => s.name === this.name);
    if (!found) throw new NotFound(404, "not_found", `no MCP server named ${JSON.stringify(this.name)} in ${this.sandboxId}`);
    this.info = found.info;
    return this.info;
  }

  /** Stops it: its process ends, open sessions close. */
  async stop(): Promise<void> {
    await this.t.json("DELETE", `/v1/sandboxes/${seg(this.sandboxId)}/mcp/${seg(this.name)}`);
  }

  /** `await using srv = await sbx.mcpServer(…)` stops it at the end of the block. */
  async [asyncDispose](): Promise<void> {
    try {
      await this.stop();
    } catch (e) {
      if (!(e instanceof NotFound)) throw e;
    }
  }
}
