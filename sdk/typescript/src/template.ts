/**
 * Templates of your own (`client.templates`): list, get and delete them; build one from a
 * Dockerfile and its context, from a template or an image with packages and run steps, or
 * from Debian packages, and follow the build's log as an async iterator; import an image
 * archive (`docker save`, or an OCI archive).
 *
 * Paths and bodies of `/v1/templates…` live here, and the small tar writer that turns a
 * context given as files (a map, or a directory on disk) into the archive the server takes.
 */

import { LockerError } from "./errors.js";
import { seg, type Transport } from "./transport.js";
import { camel, wireNetwork, type Network, type TemplateInfo } from "./types.js";
import type { WriteData } from "./files.js";

/** One file of a build context given as a map: text, bytes, or either with a mode. */
export type ContextFile = string | Uint8Array | { data: string | Uint8Array; mode?: number };

/**
 * A Dockerfile's build context: tar bytes (or a stream of them) as they are, a map of
 * relative paths to files, or the path of a directory on disk (read with `node:fs`, so
 * Node, Bun and Deno; symlinks kept as links).
 */
export type BuildContext = Uint8Array | ArrayBuffer | Blob | ReadableStream<Uint8Array> | Record<string, ContextFile> | string;

export interface BuildOptions {
  /** A Dockerfile's text (`FROM default`, `RUN`, `COPY` …; docs/api.md lists what is served). */
  dockerfile?: string;
  /** What the Dockerfile's `COPY`/`ADD` read: uploaded first (`uploadContext`). */
  context?: BuildContext;
  /** Values of the Dockerfile's `ARG`s. */
  buildArgs?: Record<string, string>;
  /** Start from a template the tenant sees. */
  template?: string;
  /** Start from an OCI image (`registry/ns/name:tag`), with `auth` for a private registry. */
  image?: string;
  auth?: { username: string; password: string };
  /** Debian packages installed with apt in the build (the `network` must reach the mirror). */
  packages?: string[];
  /** Shell steps run as root in `/`, after the packages. */
  run?: string[];
  /** What sandboxes made from the template get: env under the request's, default cwd and user. */
  env?: Record<string, string>;
  workdir?: string;
  user?: string;
  /** Started as a background process when a sandbox is created (a shell string or an argv). */
  startCmd?: string | string[];
  /** With `startCmd`: the create answers once this shell command exits 0. */
  readyCmd?: string;
  /** The build's egress (default none). */
  network?: Network;
  signal?: AbortSignal;
}

/** A build's state as `GET /v1/templates/builds/{id}` describes it. */
export interface BuildInfo {
  buildId: string;
  name: string;
  state: "queued" | "running" | "succeeded" | "failed";
  error?: string | null;
  template?: TemplateInfo | null;
  step?: number | null;
  steps?: number | null;
  /** The last 200 lines of its log. */
  log: string[];
  createdAt: string;
  finishedAt?: string | null;
  [more: string]: unknown;
}

/** One event of a build's follow stream, from its first: log lines, progress, then the result. */
export type BuildEvent =
  | { type: "log"; line: string }
  | { type: "progress"; step: number; steps: number; bytes?: number }
  | { type: "result"; state: "succeeded" | "failed"; template?: TemplateInfo; error?: string };

/** A template build that ended `failed`: its id, the server's error, and the log lines seen. */
export class BuildFailed extends LockerError {
  readonly buildId: string;
  readonly log: string[];

  constructor(buildId: string, error: string, log: string[]) {
    super(0, "build_failed", `template build ${buildId} failed: ${error}`);
    this.buildId = buildId;
    this.log = log;
  }
}

/**
 * A started build. Iterating it (`for await (const ev of build)`) follows its events from
 * the first, ending after the result; `wait()` follows it to its end and returns the
 * template, or throws `BuildFailed`.
 */
export class TemplateBuild implements AsyncIterable<BuildEvent> {
  private result: Extract<BuildEvent, { type: "result" }> | undefined;
  private readonly seen: string[] = [];

  /** @internal */
  constructor(
    private readonly templates: Templates,
    readonly id: string,
    readonly name: string,
  ) {}

  /** Its events from the first (a new stream each time), as they happen. */
  async *events(opts: { signal?: AbortSignal } = {}): AsyncGenerator<BuildEvent> {
    this.seen.length = 0;
    for await (const ev of this.templates.follow(this.id, opts)) {
      if (ev.type === "log") this.seen.push(ev.line);
      if (ev.type === "result") this.result = ev;
      yield ev;
    }
  }

  [Symbol.asyncIterator](): AsyncIterator<BuildEvent> {
    return this.events();
  }

  /** Its state now (without following). */
  status(): Promise<BuildInfo> {
    return this.templates.buildStatus(this.id);
  }

  /** Follows it to its end (passing each event but the result to `onEvent`): the template, or `BuildFailed`. */
  async wait(opts: { onEvent?: (ev: BuildEvent) => void; signal?: AbortSignal } = {}): Promise<TemplateInfo> {
    if (!this.result) {
      for await (const ev of this.events({ signal: opts.signal })) {
        if (ev.type !== "result") opts.onEvent?.(ev);
      }
    }
    const r = this.result;
    if (!r) throw new BuildFailed(this.id, "the stream ended without a result", [...this.seen]);
    if (r.state !== "succeeded" || !r.template) throw new BuildFailed(this.id, r.error ?? r.state, [...this.seen]);
    return r.template;
  }
}

export class Templates {
  /** @internal */
  constructor(private readonly t: Transport) {}

  /** The tenant's templates and the shared `default` and `code-interpreter`. */
  async list(): Promise<TemplateInfo[]> {
    return camel<TemplateInfo[]>((await this.t.json<{ templates: unknown[] }>("GET", "/v1/templates")).templates);
  }

  /** One template: digest, size, and what sandboxes from it get (env, workdir, user, startCmd, readyCmd, exposedPorts, labels). */
  async get(name: string): Promise<TemplateInfo> {
    return camel<TemplateInfo>(await this.t.json("GET", `/v1/templates/${seg(name)}`));
  }

  /** Removes a template (409 while a sandbox or snapshot stands on it, and for `default`). */
  async delete(name: string): Promise<void> {
    await this.t.json("DELETE", `/v1/templates/${seg(name)}`);
  }

  /** Uploads a Dockerfile's build context (kept 24 hours): its `contextId`. */
  async uploadContext(context: BuildContext, opts: { signal?: AbortSignal } = {}): Promise<string> {
    const body = await contextBody(context);
    const wire = await this.t.json<{ context_id: string }>("POST", "/v1/templates/contexts", {
      body,
      headers: { "Content-Type": "application/x-tar" },
      signal: opts.signal,
    });
    return wire.context_id;
  }

  /**
   * Starts building template `name` from one source (`dockerfile` with its `context`,
   * `template`, `image`, or none: Debian packages) and answers once it is queued; the
   * build's log and result come from the returned `TemplateBuild`. Errors found before the
   * build starts (a bad Dockerfile line, an unknown context) are thrown here.
   */
  async build(name: string, opts: BuildOptions): Promise<TemplateBuild> {
    const sources = [opts.dockerfile, opts.template, opts.image].filter((s) => s !== undefined);
    if (sources.length > 1) throw new TypeError("give one of dockerfile, template or image");
    if (opts.context !== undefined && opts.dockerfile === undefined) {
      throw new TypeError("`context` goes with `dockerfile`");
    }
    const body: Record<string, unknown> = { name };
    if (opts.dockerfile !== undefined) {
      const from: Record<string, unknown> = { dockerfile: opts.dockerfile };
      if (opts.context !== undefined) from["context_id"] = await this.uploadContext(opts.context, opts);
      body["from"] = from;
    } else if (opts.template !== undefined) {
      body["from"] = { template: opts.template };
    } else if (opts.image !== undefined) {
      body["from"] = opts.auth ? { image: opts.image, auth: opts.auth } : { image: opts.image };
    }
    const put = (k: string, v: unknown) => {
      if (v !== undefined) body[k] = v;
    };
    put("build_args", opts.buildArgs);
    put("packages", opts.packages);
    put("run", opts.run);
    put("env", opts.env);
    put("workdir", opts.workdir);
    put("user", opts.user);
    put("start_cmd", opts.startCmd);
    put("ready_cmd", opts.readyCmd);
    put("network", wireNetwork(opts.network));
    const wire = await this.t.json<{ build_id: string }>("POST", "/v1/templates", { body, signal: opts.signal });
    return new TemplateBuild(this, wire.build_id, name);
  }

  /** A build's state, error, template and last log lines. */
  async buildStatus(buildId: string): Promise<BuildInfo> {
    return camel<BuildInfo>(await this.t.json("GET", `/v1/templates/builds/${seg(buildId)}`));
  }

  /** A build's events from its first, as they happen; ends after the result. */
  async *follow(buildId: string, opts: { signal?: AbortSignal } = {}): AsyncGenerator<BuildEvent> {
    const events = this.t.ndjson("GET", `/v1/templates/builds/${seg(buildId)}`, {
      query: { follow: true },
      signal: opts.signal,
    });
    for await (const ev of events) {
      const e = camel<BuildEvent>(ev);
      yield e;
      if (e.type === "result") return;
    }
  }

  /**
   * Imports an image archive as template `name`: the tar `docker save` writes, or an OCI
   * archive (`skopeo copy … oci-archive:`), streamed as it is read. Tenant `default` only.
   * The answer carries the image's run config as `config` (env, workdir, user, startCmd,
   * exposedPorts, labels).
   */
  async importImage(name: string, archive: WriteData, opts: { signal?: AbortSignal } = {}): Promise<TemplateInfo> {
    const body = typeof archive === "string" ? new TextEncoder().encode(archive) : archive;
    const wire = await this.t.json("PUT", `/v1/templates/${seg(name)}/image`, {
      body: isIterable(body) ? iterStream(body) : body,
      headers: { "Content-Type": "application/x-tar" },
      signal: opts.signal,
    });
    return camel<TemplateInfo>(wire);
  }
}

function isIterable(b: unknown): b is AsyncIterable<Uint8Array> {
  return !!b && typeof b === "object" && !(b instanceof ReadableStream) && Symbol.asyncIterator in b;
}

function iterStream(it: AsyncIterable<Uint8Array>): ReadableStream<Uint8Array> {
  const iter = it[Symbol.asyncIterator]();
  return new ReadableStream<Uint8Array>({
    async pull(ctl) {
      const { value, done } = await iter.next();
      if (done) ctl.close();
      else ctl.enqueue(value);
    },
    async cancel() {
      await iter.return?.();
    },
  });
}

/** The upload body of a context: tar bytes as given, or a tar made of a map or a directory. */
async function contextBody(c: BuildContext): Promise<Uint8Array | ArrayBuffer | Blob | ReadableStream<Uint8Array>> {
  if (typeof c === "string") return tar(await readDir(c));
  if (c instanceof Uint8Array || c instanceof ArrayBuffer || c instanceof ReadableStream) return c;
  if (typeof Blob !== "undefined" && c instanceof Blob) return c;
  const entries: TarEntry[] = [];
  for (const [path, f] of Object.entries(c as Record<string, ContextFile>)) {
    const file = typeof f === "string" || f instanceof Uint8Array ? { data: f } : f;
    const data = typeof file.data === "string" ? new TextEncoder().encode(file.data) : file.data;
    entries.push({ path, kind: "file", mode: file.mode ?? 0o644, data });
  }
  return tar(entries);
}

interface TarEntry {
  path: string;
  kind: "file" | "dir" | "symlink";
  mode: number;
  data?: Uint8Array;
  link?: string;
}

/** Minimal `node:fs/promises` as used here (the package has no Node types at build time). */
interface FsLike {
  readdir(p: string): Promise<string[]>;
  lstat(p: string): Promise<{ isDirectory(): boolean; isFile(): boolean; isSymbolicLink(): boolean; mode: number }>;
  readFile(p: string): Promise<Uint8Array>;
  readlink(p: string): Promise<string>;
}

/** A directory's entries (relative paths, sorted, depth first); sockets and devices are refused. */
async function readDir(root: string): Promise<TarEntry[]> {
  // Not a literal import: the package builds without Node's types and runs where there is no `node:fs`.
  const spec: string = "node:fs/promises";
  const fs = (await import(spec)) as FsLike;
  const out: TarEntry[] = [];
  const walk = async (rel: string) => {
    const names = (await fs.readdir(rel ? `${root}/${rel}` : root)).sort();
    for (const n of names) {
      const path = rel ? `${rel}/${n}` : n;
      const full = `${root}/${path}`;
      const st = await fs.lstat(full);
      const mode = st.mode & 0o7777;
      if (st.isSymbolicLink()) out.push({ path, kind: "symlink", mode, link: await fs.readlink(full) });
      else if (st.isDirectory()) {
        out.push({ path, kind: "dir", mode });
        await walk(path);
      } else if (st.isFile()) out.push({ path, kind: "file", mode, data: await fs.readFile(full) });
      else throw new TypeError(`${full}: only files, directories and symlinks go into a build context`);
    }
  };
  const top = await fs.lstat(root).catch(() => undefined);
  if (!top?.isDirectory()) throw new TypeError(`the build context ${JSON.stringify(root)} is not a directory`);
  await walk("");
  return out;
}

/**
 * A ustar archive of `entries`, with the parent directories a map leaves implicit. Names
 * over 100 bytes go into the header's prefix field; longer ones than that field allows are
 * refused rather than cut.
 */
function tar(entries: TarEntry[]): Uint8Array {
  const enc = new TextEncoder();
  const all: TarEntry[] = [];
  const dirs = new Set(entries.filter((e) => e.kind === "dir").map((e) => e.path));
  for (const e of entries) {
    const path = e.path.replace(/^\.?\/+/, "");
    if (!path || path.split("/").includes("..")) throw new TypeError(`a context path must stay inside: ${JSON.stringify(e.path)}`);
    const parts = path.split("/");
    for (let i = 1; i < parts.length; i++) {
      const d = parts.slice(0, i).join("/");
      if (!dirs.has(d)) {
        dirs.add(d);
        all.push({ path: d, kind: "dir", mode: 0o755 });
      }
    }
    all.push({ ...e, path });
  }
  const blocks: Uint8Array[] = [];
  for (const e of all) {
    const data = e.kind === "file" ? (e.data ?? new Uint8Array()) : new Uint8Array();
    const h = new Uint8Array(512);
    const name = enc.encode(e.kind === "dir" ? `${e.path}/` : e.path);
    let prefix = new Uint8Array();
    let short = name;
    if (name.length > 100) {
      // The last `/` that leaves at most 155 bytes before it and 100 after.
      const at = [...Array(name.length).keys()].reverse().find((i) => name[i] === 0x2f && i <= 155 && name.length - i - 1 <= 100);
      if (at === undefined) throw new TypeError(`a context path is too long for tar: ${e.path}`);
      prefix = name.subarray(0, at);
      short = name.subarray(at + 1);
    }
    const field = (off: number, len: number, v: Uint8Array) => h.set(v.subarray(0, len), off);
    const octal = (off: number, len: number, n: number) => field(off, len, enc.encode(n.toString(8).padStart(len - 1, "0") + "\0"));
    field(0, 100, short);
    octal(100, 8, e.mode & 0o7777);
    octal(108, 8, 0);
    octal(116, 8, 0);
    octal(124, 12, data.length);
    octal(136, 12, 0);
    h.set(enc.encode("        "), 148);
    h[156] = e.kind === "file" ? 0x30 : e.kind === "dir" ? 0x35 : 0x32;
    if (e.link) field(157, 100, enc.encode(e.link));
    field(257, 6, enc.encode("ustar\0"));
    field(263, 2, enc.encode("00"));
    field(345, 155, prefix);
    let sum = 0;
    for (const b of h) sum += b;
    field(148, 8, enc.encode(sum.toString(8).padStart(6, "0") + "\0 "));
    blocks.push(h, data);
    if (data.length % 512) blocks.push(new Uint8Array(512 - (data.length % 512)));
  }
  blocks.push(new Uint8Array(1024));
  const out = new Uint8Array(blocks.reduce((n, b) => n + b.length, 0));
  let off = 0;
  for (const b of blocks) {
    out.set(b, off);
    off += b.length;
  }
  return out;
}
