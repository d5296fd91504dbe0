/**
 * Sandboxes: create, get, list, and everything done to one — exec (whole or streamed),
 * background processes, files, TTL, network and metadata, pause and resume, snapshots and
 * forks, ports and preview URLs, its call records — and `await using` disposal, which
 * deletes it.
 *
 * Paths and bodies of `/v1/sandboxes…` and `/v1/snapshots…` live here; the transport
 * and the shapes are in their own modules.
 */

import { Transport, seg, type ClientOptions } from "./transport.js";
import { NotFound } from "./errors.js";
import { asyncDispose } from "./dispose.js";
import { Files } from "./files.js";
import { openPty, type Pty, type PtyOptions } from "./pty.js";
import { CodeContext, runCode, streamCode, type CodeEvent, type CreateContextOptions, type Execution, type RunCodeOptions } from "./code.js";
import { McpServer, type McpServerOptions } from "./mcp.js";
import { Processes, execBody, execFed, isFed, streamCommand, type Command, type ExecOptions } from "./exec.js";
import {
  camel,
  execResult,
  snake,
  wireNetwork,
  type CallRecord,
  type ExecResult,
  type Network,
  type Port,
  type SandboxInfo,
  type SandboxState,
  type Snapshot,
  type StreamEvent,
  type VolumeMount,
} from "./types.js";

/** The working directory `Sandbox.create` makes and execs start in, unless told otherwise. */
export const DEFAULT_WORKDIR = "/workspace";

export interface CreateOptions {
  template?: string;
  runtime?: "auto" | "jail" | "microvm" | "gvisor";
  cpus?: number;
  memoryMb?: number;
  diskMb?: number;
  /** Seconds until it is destroyed (default 1800). */
  ttlSeconds?: number;
  /** Paused after this many seconds with no call (default: never). */
  idleTimeoutSeconds?: number;
  env?: Record<string, string>;
  /** Egress: `{ internet: false }` (the default: no network), `{ internet: true }`, `{ allow: ["pypi.org"] }`, or the API's `{ egress, allow }`. */
  network?: Network;
  volumes?: VolumeMount[];
  fromSnapshot?: string;
  metadata?: Record<string, string>;
  /**
   * Secrets by name (`client.secrets.create`): each one's env variable holds a placeholder,
   * and the egress proxy puts the value into requests to the secret's hosts only.
   */
  secrets?: string[];
  /**
   * The directory execs and processes start in when they name no `cwd`: made right after
   * the sandbox (default `/workspace`). `null`: none is made, commands start in the
   * user's home as the API does.
   */
  workdir?: string | null;
  signal?: AbortSignal;
}

export interface ListFilter {
  state?: SandboxState;
  /** Only sandboxes whose metadata has every one of these pairs. */
  metadata?: Record<string, string>;
}

/** How `Sandbox.get`/`list`/`create` reach the server (a client's, or the environment's). */
export type Connection = ClientOptions | { transport: Transport };

function transportOf(c: Connection | undefined): Transport {
  if (c && "transport" in c) return c.transport;
  return new Transport(c ?? {});
}

function createBody(o: CreateOptions): Record<string, unknown> {
  return snake({
    template: o.template,
    runtime: o.runtime,
    cpus: o.cpus,
    memoryMb: o.memoryMb,
    diskMb: o.diskMb,
    ttlS: o.ttlSeconds,
    idleTimeoutS: o.idleTimeoutSeconds,
    env: o.env,
    network: wireNetwork(o.network),
    volumes: o.volumes?.map((v) => snake({ ...v })),
    fromSnapshot: o.fromSnapshot,
    metadata: o.metadata,
    secrets: o.secrets,
  });
}

function checkPort(port: number): number {
  if (!Number.isInteger(port) || port < 1 || port > 65535) {
    throw new RangeError(`a port is an integer from 1 to 65535, got ${port}`);
  }
  return port;
}

/** One sandbox: a machine that runs commands, with its own files, processes and ports. */
export class Sandbox {
  readonly id: string;
  /** What the server said about it last (`refresh()` asks again). */
  info: SandboxInfo;
  /** The directory commands start in when they name no `cwd` (undefined: the user's home). */
  workdir: string | undefined;
  readonly files: Files;
  readonly processes: Processes;
  /** @internal */
  readonly transport: Transport;
  private readonly base: string;

  /** @internal */
  constructor(t: Transport, info: SandboxInfo, workdir?: string) {
    this.transport = t;
    this.info = info;
    this.id = info.id;
    this.workdir = workdir;
    this.base = `/v1/sandboxes/${seg(info.id)}`;
    this.files = new Files(t, this.base);
    this.processes = new Processes(t, info.id, () => this.workdir);
  }

  /** Creates a sandbox (201) and its `workdir`. Reaches the server of `LOCKER_URL` unless `url`/`apiKey` say otherwise. */
  static async create(opts: CreateOptions & ClientOptions = {}, conn?: Connection): Promise<Sandbox> {
    const t = transportOf(conn ?? { url: opts.url, apiKey: opts.apiKey, fetch: opts.fetch });
    const wire = await t.json("POST", "/v1/sandboxes", { body: createBody(opts), signal: opts.signal });
    const sbx = new Sandbox(t, camel<SandboxInfo>(wire));
    const workdir = opts.workdir === undefined ? DEFAULT_WORKDIR : opts.workdir;
    if (workdir !== null) {
      try {
        await sbx.files.mkdir(workdir);
      } catch (e) {
        await sbx.delete().catch(() => undefined);
        throw e;
      }
      sbx.workdir = workdir;
    }
    return sbx;
  }

  /** The sandbox `id`; commands start in `workdir` if given, else the user's home. */
  static async get(id: string, opts: { workdir?: string } = {}, conn?: Connection): Promise<Sandbox> {
    const t = transportOf(conn);
    return new Sandbox(t, camel<SandboxInfo>(await t.json("GET", `/v1/sandboxes/${seg(id)}`)), opts.workdir);
  }

  /** The tenant's sandboxes, filtered by state and metadata. */
  static async list(filter: ListFilter = {}, conn?: Connection): Promise<Sandbox[]> {
    const t = transportOf(conn);
    const query: Record<string, string> = {};
    if (filter.state) query["state"] = filter.state;
    for (const [k, v] of Object.entries(filter.metadata ?? {})) query[`metadata.${k}`] = v;
    const d = await t.json<{ sandboxes: unknown[] }>("GET", "/v1/sandboxes", { query });
    return (d.sandboxes ?? []).map((s) => new Sandbox(t, camel<SandboxInfo>(s)));
  }

  get state(): SandboxState {
    return this.info.state;
  }

  /** Asks the server for its state now. */
  async refresh(): Promise<SandboxInfo> {
    this.info = camel<SandboxInfo>(await this.transport.json("GET", this.base));
    return this.info;
  }

  /** Destroys it now, with everything in it. */
  async delete(): Promise<void> {
    await this.transport.json("DELETE", this.base);
  }

  /** `await using sbx = await Sandbox.create()` deletes it at the end of the block (one already gone is fine). */
  async [asyncDispose](): Promise<void> {
    try {
      await this.delete();
    } catch (e) {
      if (!(e instanceof NotFound)) throw e;
    }
  }

  /**
   * Runs a command to its end. A non-zero exit, a timeout (`timedOut: true`, the output so
   * far kept) or a kill is a result, never an exception; exceptions are the platform's.
   */
  async exec(cmd: Command, opts: ExecOptions = {}): Promise<ExecResult> {
    if (isFed(opts.stdin)) return execFed(this.processes, cmd, opts);
    const body = execBody(cmd, opts, this.workdir);
    return execResult(await this.transport.json("POST", `${this.base}/exec`, { body, signal: opts.signal }));
  }

  /**
   * Runs a command and yields its output as it arrives; the last event is its result.
   * Breaking out of the loop or aborting `signal` closes the stream, which kills the command.
   */
  execStream(cmd: Command, opts: ExecOptions = {}): AsyncGenerator<StreamEvent, void, undefined> {
    if (isFed(opts.stdin)) {
      throw new TypeError("a streamed stdin is for exec(); for output as it comes too, start a process and follow its output");
    }
    const body = execBody(cmd, opts, this.workdir);
    return streamCommand(this.transport, "POST", `${this.base}/exec`, body, opts.signal);
  }

  /** A terminal running `cmd` (default a login shell); see `Pty`. Needs a WebSocket that sends headers. */
  pty(opts: PtyOptions = {}): Promise<Pty> {
    return openPty(this.transport, this.base, opts);
  }

  /**
   * A code context: a Jupyter kernel whose variables and imports persist between cells
   * (sandboxes of the `code-interpreter` template; another template answers Conflict).
   */
  createCodeContext(opts: CreateContextOptions = {}): Promise<CodeContext> {
    return CodeContext.create(this.transport, this.id, opts);
  }

  /** Its code contexts. */
  codeContexts(): Promise<CodeContext[]> {
    return CodeContext.list(this.transport, this.id);
  }

  /**
   * Runs a cell in `opts.context`, else the sandbox's default context of its language. An
   * exception in the cell is the Execution's `error`, never thrown.
   */
  runCode(code: string, opts: RunCodeOptions = {}): Promise<Execution> {
    return runCode(this.transport, this.id, code, opts);
  }

  /** Runs a cell, its output as it comes; the last event is its Execution. */
  runCodeStream(code: string, opts: RunCodeOptions = {}): AsyncGenerator<CodeEvent, void, undefined> {
    return streamCode(this.transport, this.id, code, opts);
  }

  /**
   * Starts a stdio MCP server in the sandbox (`cmd`, e.g. `["npx", "-y",
   * "@modelcontextprotocol/server-filesystem", "/workspace"]`) and serves it as Streamable
   * HTTP at `server.url` (send `server.headers`); resolves once it answered `initialize`
   * (BadGateway with its exit code and stderr when it did not).
   */
  mcpServer(name: string, cmd: readonly string[], opts: McpServerOptions = {}): Promise<McpServer> {
    return McpServer.start(this.transport, this.id, name, cmd, opts);
  }

  /** The MCP servers started in it (running or exited). */
  mcpServers(): Promise<McpServer[]> {
    return McpServer.list(this.transport, this.id);
  }

  /** Sets `expiresAt` to now + `seconds`. */
  async setTtl(seconds: number): Promise<SandboxInfo> {
    this.info = camel<SandboxInfo>(await this.transport.json("POST", `${this.base}/ttl`, { body: { ttl_s: seconds } }));
    return this.info;
  }

  /** Changes its network policy and/or metadata while it runs. */
  async update(change: { network?: Network; metadata?: Record<string, string> }): Promise<SandboxInfo> {
    const body = snake({ network: wireNetwork(change.network), metadata: change.metadata });
    this.info = camel<SandboxInfo>(await this.transport.json("PATCH", this.base, { body }));
    return this.info;
  }

  /** Freezes every process in it. */
  async pause(): Promise<void> {
    await this.transport.json("POST", `${this.base}/pause`);
  }

  async resume(): Promise<void> {
    await this.transport.json("POST", `${this.base}/resume`);
  }

  /** Snapshots its filesystem (and memory where the runtime can). */
  async snapshot(): Promise<Snapshot> {
    return camel<Snapshot>(await this.transport.json("POST", `${this.base}/snapshots`));
  }

  /** `count` new sandboxes from a snapshot taken now (they inherit this handle's `workdir`). */
  async fork(count = 1): Promise<Sandbox[]> {
    const d = await this.transport.json<{ sandboxes: unknown[] }>("POST", `${this.base}/fork`, { body: { count } });
    return d.sandboxes.map((s) => new Sandbox(this.transport, camel<SandboxInfo>(s), this.workdir));
  }

  /** The TCP ports listening in it now. */
  async ports(): Promise<Port[]> {
    const d = await this.transport.json<{ ports: unknown[] }>("GET", `${this.base}/ports`);
    return camel<Port[]>(d.ports);
  }

  /**
   * The path proxy's URL of `port` (send the API key as a Bearer token): for code, since it
   * needs no DNS name. For a browser use `previewUrl`.
   */
  url(port: number, path = "/"): string {
    return `${this.transport.url}${this.base}/ports/${checkPort(port)}/${path.replace(/^\/+/, "")}`;
  }

  /**
   * The preview URL of `port` (`http://{port}-{id}.{domain}/…`) for a person's browser, with
   * `?locker_token=` unless `token: false`; null when the server has no preview domain.
   */
  async previewUrl(port: number, opts: { path?: string; token?: boolean } = {}): Promise<string | null> {
    checkPort(port);
    if (this.info.previewUrl === undefined) await this.refresh();
    const template = this.info.previewUrl;
    if (!template) return null;
    let url = template.replace("{port}", String(port)).replace(/\/+$/, "") + "/" + (opts.path ?? "/").replace(/^\/+/, "");
    if ((opts.token ?? true) && this.info.previewToken) {
      url += (url.includes("?") ? "&" : "?") + "locker_token=" + encodeURIComponent(this.info.previewToken);
    }
    return url;
  }

  /** Makes `port` public (`public: false`: private again) and returns its URL. */
  async expose(port: number, opts: { public?: boolean } = {}): Promise<string> {
    const d = await this.transport.json<{ url: string }>("PUT", `${this.base}/ports/${checkPort(port)}`, {
      body: { public: opts.public ?? true },
    });
    return d.url;
  }

  /** A new preview token; the old one and the cookies made from it stop working. */
  async rotatePreviewToken(): Promise<string> {
    const d = await this.transport.json<{ preview_token: string; preview_url: string | null }>(
      "POST",
      `${this.base}/preview-token`,
    );
    this.info.previewToken = d.preview_token;
    this.info.previewUrl = d.preview_url;
    return d.preview_token;
  }

  /** The records of its execs, newest first. */
  async calls(opts: { limit?: number } = {}): Promise<CallRecord[]> {
    const d = await this.transport.json<{ calls: unknown[] }>("GET", "/v1/calls", {
      query: { sandbox_id: this.id, limit: opts.limit },
    });
    return camel<CallRecord[]>(d.calls);
  }
}
