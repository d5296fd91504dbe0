/**
 * The OpenAI Agents SDK's door (`locker-sandbox/openai-agents`):
 *
 * - `LockerSandboxClient`: the SDK's sandbox provider interface (`SandboxClient`, as its
 *   Docker and local clients implement it) backed by Locker, so a `SandboxAgent` runs its
 *   shell and filesystem capabilities in a Locker sandbox:
 *
 *       const result = await run(agent, "Fix the test", { sandbox: { client: new LockerSandboxClient() } });
 *
 *   `create` makes a sandbox (options: template, network, cpus, memoryMb, ttlSeconds,
 *   metadata) with the manifest's root as its working directory, its `file`, `dir`,
 *   `localFile` and `localDir` entries written there and its environment set; the session
 *   runs `exec_command` with bash (a login shell unless told otherwise), reads, lists and
 *   edits files (V4A diffs through the SDK's `applyDiff`), exposes ports (the preview URL),
 *   and `delete` destroys the sandbox. `resume` reattaches a session state to its sandbox.
 *   Git repositories and cloud mounts are refused with a message saying what works; the
 *   SDK's workspace snapshot specs are not used (Locker's own snapshots and volumes are).
 * - `lockerAgentTools(sbx)`: plain function tools (`bash`, `read_file`, `write_file`,
 *   `edit_file`, and `run_code` with `code: true`) for an ordinary `Agent`.
 *
 * `@openai/agents` and `zod` are peer dependencies, needed only here. Owns no route.
 */

import { applyDiff, tool, type Tool } from "@openai/agents";
import {
  Manifest,
  normalizeSandboxClientCreateArgs,
  type ExecCommandArgs,
  type ExposedPortEndpoint,
  type ListDirectoryArgs,
  type MaterializeEntryArgs,
  type ReadFileArgs,
  type SandboxClient,
  type SandboxClientCreateArgs,
  type SandboxClientOptions,
  type SandboxDirectoryEntry,
  type SandboxExecResult,
  type SandboxSession,
  type SandboxSessionState,
} from "@openai/agents/sandbox";
import { z } from "zod";
import { readFile as readHostFile, readdir, stat as statHost } from "node:fs/promises";
import { join as joinHost } from "node:path";
import { Sandbox } from "./sandbox.js";
import { NotFound } from "./errors.js";
import type { ClientOptions } from "./transport.js";
import type { Network } from "./types.js";
import type { CodeContext } from "./code.js";
import { BashSession, CodeCells, RUN_CODE_DESCRIPTION, TextEditor, errorText, type BashOptions } from "./tools.js";

/** How `LockerSandboxClient` makes sandboxes (per client, or per run as `sandbox.options`). */
export interface LockerSandboxClientOptions extends SandboxClientOptions {
  template?: string;
  network?: Network;
  cpus?: number;
  memoryMb?: number;
  diskMb?: number;
  /** Seconds until Locker destroys it if the run never does (default 3600). */
  ttlSeconds?: number;
  metadata?: Record<string, string>;
  /** A command's limit (default 600 000 ms); it is killed after. */
  execTimeoutMs?: number;
}

/** The session state: the SDK's, plus the Locker sandbox it runs in. */
export interface LockerSandboxSessionState extends SandboxSessionState {
  sandboxId: string;
  /** Locker's URL and the working directory, to reattach. */
  lockerUrl: string;
  environment: Record<string, string>;
}

function rootOf(m: Manifest): string {
  return m.root || "/workspace";
}

/** An absolute path in the sandbox: absolute as given, else under the manifest's root. */
function resolvePath(root: string, p: string | undefined): string {
  if (!p || p === ".") return root;
  if (p.startsWith("/")) return p;
  return `${root.replace(/\/+$/, "")}/${p.replace(/^\.\//, "")}`;
}

function bytesOf(v: unknown): string | Uint8Array {
  if (typeof v === "string" || v instanceof Uint8Array) return v;
  if (v instanceof ArrayBuffer) return new Uint8Array(v);
  throw new TypeError("a file entry's content is a string or bytes");
}

/** Writes one manifest entry at `at` in the sandbox (and a directory's children). */
async function materialize(sbx: Sandbox, at: string, entry: Record<string, unknown>): Promise<void> {
  const type = entry["type"];
  if (type === "file") {
    await sbx.files.write(at, bytesOf(entry["content"]));
  } else if (type === "dir") {
    await sbx.files.mkdir(at);
    const children = (entry["children"] ?? {}) as Record<string, Record<string, unknown>>;
    for (const [name, child] of Object.entries(children)) await materialize(sbx, `${at}/${name}`, child);
  } else if (type === "local_file") {
    await sbx.files.write(at, new Uint8Array(await readHostFile(String(entry["src"]))));
  } else if (type === "local_dir") {
    const walk = async (src: string, dst: string): Promise<void> => {
      await sbx.files.mkdir(dst);
      for (const d of await readdir(src, { withFileTypes: true })) {
        if (d.isDirectory()) await walk(joinHost(src, d.name), `${dst}/${d.name}`);
        else if (d.isFile()) await sbx.files.write(`${dst}/${d.name}`, new Uint8Array(await readHostFile(joinHost(src, d.name))));
      }
    };
    if (!(await statHost(String(entry["src"]))).isDirectory()) throw new TypeError(`local_dir ${String(entry["src"])} is not a directory`);
    await walk(String(entry["src"]), at);
  } else {
    throw new TypeError(
      `LockerSandboxClient cannot materialize a manifest entry of type ${JSON.stringify(type)} at ${at}: it takes file, dir, local_file and local_dir entries ` +
        "(clone a repository with exec_command, or put what it needs on a Locker volume).",
    );
  }
}

async function materializeManifest(sbx: Sandbox, manifest: Manifest): Promise<void> {
  const root = rootOf(manifest);
  await sbx.files.mkdir(root);
  for (const [path, entry] of Object.entries(manifest.entries)) {
    await materialize(sbx, resolvePath(root, path), entry as unknown as Record<string, unknown>);
  }
}

/** A Locker sandbox as the Agents SDK's sandbox session. */
export class LockerSandboxSession implements SandboxSession<LockerSandboxSessionState> {
  constructor(
    readonly sandbox: Sandbox,
    readonly state: LockerSandboxSessionState,
    private readonly execTimeoutMs = 600_000,
  ) {}

  private get root(): string {
    return rootOf(this.state.manifest);
  }

  async running(): Promise<boolean> {
    try {
      return (await this.sandbox.refresh()).state === "running";
    } catch (e) {
      if (e instanceof NotFound) return false;
      throw e;
    }
  }

  async exec(args: ExecCommandArgs): Promise<SandboxExecResult> {
    const started = Date.now();
    const shell = args.shell ?? "bash";
    const r = await this.sandbox.exec([shell, (args.login ?? true) ? "-lc" : "-c", args.cmd], {
      cwd: resolvePath(this.root, args.workdir),
      env: this.state.environment,
      timeoutMs: this.execTimeoutMs,
      user: args.runAs,
    });
    let output = r.stdout + (r.stderr ? (r.stdout && !r.stdout.endsWith("\n") ? "\n" : "") + r.stderr : "");
    // maxOutputTokens: about 4 characters a token, head and tail kept.
    const maxChars = args.maxOutputTokens ? args.maxOutputTokens * 4 : undefined;
    let originalTokenCount: number | undefined;
    if (maxChars && output.length > maxChars) {
      originalTokenCount = Math.ceil(output.length / 4);
      const head = Math.floor(maxChars / 2);
      output = `${output.slice(0, head)}\n…${output.length - maxChars} characters truncated…\n${output.slice(output.length - (maxChars - head))}`;
    }
    if (r.timedOut) output += `\n[killed after ${this.execTimeoutMs / 1000} s]`;
    if (r.stdoutTruncated || r.stderrTruncated) output += `\n[output truncated; the full output is in ${r.outputPath} in the sandbox]`;
    return {
      output,
      stdout: r.stdout,
      stderr: r.stderr,
      wallTimeSeconds: (Date.now() - started) / 1000,
      exitCode: r.exitCode ?? (r.timedOut ? 124 : 137),
      ...(originalTokenCount !== undefined ? { originalTokenCount } : {}),
    };
  }

  async execCommand(args: ExecCommandArgs): Promise<string> {
    const r = await this.exec(args);
    const lines = [`Wall time: ${r.wallTimeSeconds.toFixed(4)} seconds`, `Process exited with code ${r.exitCode}`];
    if (r.originalTokenCount !== undefined) lines.push(`Original token count: ${r.originalTokenCount}`);
    lines.push("Output:", r.output);
    return lines.join("\n");
  }

  supportsPty(): boolean {
    return false;
  }

  async readFile(args: ReadFileArgs): Promise<Uint8Array> {
    const data = await this.sandbox.files.read(resolvePath(this.root, args.path));
    return args.maxBytes !== undefined && data.length > args.maxBytes ? data.subarray(0, args.maxBytes) : data;
  }

  async listDir(args: ListDirectoryArgs): Promise<SandboxDirectoryEntry[]> {
    const entries = await this.sandbox.files.list(resolvePath(this.root, args.path));
    return entries.map((e) => ({ name: e.name, path: e.path, type: e.type === "file" ? "file" : e.type === "dir" ? "dir" : "other" }));
  }

  async pathExists(path: string): Promise<boolean> {
    return this.sandbox.files.exists(resolvePath(this.root, path));
  }

  async directoryExists(path: string): Promise<boolean> {
    try {
      return (await this.sandbox.files.stat(resolvePath(this.root, path))).type === "dir";
    } catch (e) {
      if (e instanceof NotFound) return false;
      throw e;
    }
  }

  /** The SDK's editor (apply_patch): V4A diffs applied to the sandbox's files. */
  createEditor() {
    const files = this.sandbox.files;
    const at = (p: string) => resolvePath(this.root, p);
    return {
      createFile: async (op: { path: string; diff: string }) => {
        await files.write(at(op.path), applyDiff("", op.diff, "create"));
        return { status: "completed" as const, output: `Created ${op.path}` };
      },
      updateFile: async (op: { path: string; diff: string; moveTo?: string }) => {
        let text: string;
        try {
          text = await files.readText(at(op.path));
        } catch (e) {
          if (e instanceof NotFound) return { status: "failed" as const, output: `Cannot update ${op.path}: it does not exist` };
          throw e;
        }
        let mode: string | undefined;
        try {
          mode = ((await files.stat(at(op.path))).mode & 0o7777).toString(8).padStart(4, "0");
        } catch {
          mode = undefined;
        }
        const target = op.moveTo ? at(op.moveTo) : at(op.path);
        await files.write(target, applyDiff(text, op.diff), { mode });
        if (op.moveTo && target !== at(op.path)) {
          await files.remove(at(op.path));
          return { status: "completed" as const, output: `Updated ${op.path} and moved it to ${op.moveTo}` };
        }
        return { status: "completed" as const, output: `Updated ${op.path}` };
      },
      deleteFile: async (op: { path: string }) => {
        try {
          await files.remove(at(op.path));
        } catch (e) {
          if (e instanceof NotFound) return { status: "failed" as const, output: `Cannot delete ${op.path}: it does not exist` };
          throw e;
        }
        return { status: "completed" as const, output: `Deleted ${op.path}` };
      },
    };
  }

  async materializeEntry(args: MaterializeEntryArgs): Promise<void> {
    await materialize(this.sandbox, resolvePath(this.root, args.path), args.entry as unknown as Record<string, unknown>);
  }

  async applyManifest(manifest: Manifest): Promise<void> {
    await materializeManifest(this.sandbox, manifest);
    Object.assign(this.state.environment, await manifest.resolveEnvironment());
  }

  /** A port of the sandbox as a URL a browser or client reaches (made public: the preview URL, else the path proxy's). */
  async resolveExposedPort(port: number): Promise<ExposedPortEndpoint> {
    const url = new URL(await this.sandbox.expose(port));
    const tls = url.protocol === "https:";
    const endpoint: ExposedPortEndpoint = { host: url.hostname, port: Number(url.port || (tls ? 443 : 80)), tls, url: url.href };
    if (url.pathname !== "/") endpoint["path"] = url.pathname;
    (this.state.exposedPorts ??= {})[String(port)] = endpoint;
    return endpoint;
  }

  /** Destroys the sandbox (one already gone is fine). */
  async delete(): Promise<void> {
    try {
      await this.sandbox.delete();
    } catch (e) {
      if (!(e instanceof NotFound)) throw e;
    }
  }
}

/** The Agents SDK's sandbox client backed by Locker (`LOCKER_URL`/`LOCKER_API_KEY` unless `url`/`apiKey` say otherwise). */
export class LockerSandboxClient implements SandboxClient<LockerSandboxClientOptions, LockerSandboxSessionState> {
  readonly backendId = "locker";
  readonly supportsDefaultOptions = true;

  constructor(
    private readonly options: LockerSandboxClientOptions = {},
    private readonly connection: ClientOptions = {},
  ) {}

  async create(
    args?: SandboxClientCreateArgs<LockerSandboxClientOptions> | Manifest,
    manifestOptions?: LockerSandboxClientOptions,
  ): Promise<LockerSandboxSession> {
    const a = normalizeSandboxClientCreateArgs(args, manifestOptions);
    // The SDK's workspace snapshot specs (archives of the workspace kept on the host) are not
    // used: a Locker sandbox keeps its files until it is deleted, `Sandbox#snapshot()` and
    // `fork()` snapshot it, and a Locker volume keeps work across sandboxes.
    const o = { ...this.options, ...a.options };
    const manifest = a.manifest;
    const environment = await manifest.resolveEnvironment();
    const sbx = await Sandbox.create({
      ...this.connection,
      template: o.template,
      network: o.network,
      cpus: o.cpus,
      memoryMb: o.memoryMb,
      diskMb: o.diskMb,
      ttlSeconds: o.ttlSeconds ?? 3600,
      metadata: { ...o.metadata, "openai-agents": "sandbox" },
      workdir: rootOf(manifest),
    });
    try {
      await materializeManifest(sbx, manifest);
    } catch (e) {
      await sbx.delete().catch(() => undefined);
      throw e;
    }
    const state: LockerSandboxSessionState = {
      manifest,
      sandboxId: sbx.id,
      lockerUrl: sbx.transport.url,
      environment,
      workspaceReady: true,
    };
    return new LockerSandboxSession(sbx, state, o.execTimeoutMs);
  }

  /** Reattaches a session state to its sandbox (NotFound once the sandbox is gone). */
  async resume(state: LockerSandboxSessionState): Promise<LockerSandboxSession> {
    const sbx = await Sandbox.get(state.sandboxId, { workdir: rootOf(state.manifest) }, { ...this.connection, url: this.connection.url ?? state.lockerUrl });
    if (sbx.state === "paused") await sbx.resume();
    return new LockerSandboxSession(sbx, state, this.options.execTimeoutMs);
  }

  async delete(state: LockerSandboxSessionState): Promise<void> {
    const s = await this.resume(state).catch((e: unknown) => {
      if (e instanceof NotFound) return undefined;
      throw e;
    });
    await s?.delete();
  }
}

export interface AgentToolsOptions {
  bash?: BashOptions;
  /** Add `run_code` (a context made on first use, or this one; template `code-interpreter`). */
  code?: boolean | CodeContext;
}

/** A tool body whose failure is answered to the model as text (the SDK would otherwise stop the run). */
async function answer(name: string, f: () => Promise<string>): Promise<string> {
  try {
    return await f();
  } catch (e) {
    return `Error: ${errorText(name, e)}`;
  }
}

/** Plain function tools for an ordinary `Agent`, bound to `sbx`. */
export function lockerAgentTools(sbx: Sandbox, opts: AgentToolsOptions = {}): Tool[] {
  const bash = new BashSession(sbx, opts.bash);
  const editor = new TextEditor(sbx.files);
  const tools: Tool[] = [
    tool({
      name: "bash",
      description: `Run a bash command in an isolated Linux sandbox (starting in ${bash.cwd}). The working directory and exported variables carry over between commands; stderr is merged into stdout; a non-zero exit is reported as [exit code: N].`,
      parameters: z.object({ command: z.string().describe("The command line to run.") }),
      execute: ({ command }) => answer("bash", () => bash.run(command)),
    }),
    tool({
      name: "read_file",
      description: "Read a text file of the sandbox with line numbers, or list a directory 2 levels deep.",
      parameters: z.object({ path: z.string().describe("Absolute path.") }),
      execute: ({ path }) => answer("read_file", () => editor.call({ command: "view", path })),
    }),
    tool({
      name: "write_file",
      description: "Create or replace a file in the sandbox (parent directories are made).",
      parameters: z.object({ path: z.string().describe("Absolute path."), content: z.string().describe("The whole content.") }),
      execute: ({ path, content }) => answer("write_file", () => editor.call({ command: "create", path, file_text: content })),
    }),
    tool({
      name: "edit_file",
      description: "Replace the one exact occurrence of old_str with new_str in a file of the sandbox (whitespace included).",
      parameters: z.object({ path: z.string(), old_str: z.string(), new_str: z.string() }),
      execute: ({ path, old_str, new_str }) => answer("edit_file", () => editor.call({ command: "str_replace", path, old_str, new_str })),
    }),
  ];
  if (opts.code) {
    const cells = new CodeCells(sbx, typeof opts.code === "object" ? opts.code : undefined);
    tools.push(
      tool({
        name: "run_code",
        description: RUN_CODE_DESCRIPTION,
        parameters: z.object({ code: z.string().describe("Python source, as in a notebook cell.") }),
        execute: ({ code }) => answer("run_code", () => cells.run(code)),
      }),
    );
  }
  return tools;
}
