/**
 * The code interpreter: stateful contexts (Jupyter kernels) in sandboxes of the
 * `code-interpreter` template, and cells run in them (`POST /v1/sandboxes/{id}/code`),
 * whole (an `Execution`) or streamed (`CodeEvent`s as they come).
 *
 * Owns the `/v1/sandboxes/{id}/contexts…` and `/v1/sandboxes/{id}/code` paths and the
 * Execution/Result shapes; the sandbox module only hands out its methods. A Result's
 * `json` is the cell's own value: its keys are never renamed.
 */

import { seg, type Transport } from "./transport.js";
import { ConnectionError, NotFound } from "./errors.js";
import { b64decode } from "./types.js";
import { asyncDispose } from "./dispose.js";

/** The MIME fields a Result may have (`png`, `jpeg`, `pdf` in base64). */
export const RESULT_FORMATS = [
  "text",
  "html",
  "markdown",
  "svg",
  "png",
  "jpeg",
  "pdf",
  "latex",
  "json",
  "javascript",
  "chart",
] as const;
export type ResultFormat = (typeof RESULT_FORMATS)[number];

/** One output of a cell: its value (`isMainResult`) or something it displayed. */
export interface CodeResult {
  isMainResult: boolean;
  text?: string;
  html?: string;
  markdown?: string;
  svg?: string;
  /** base64 */
  png?: string;
  /** base64 */
  jpeg?: string;
  /** base64 */
  pdf?: string;
  latex?: string;
  /** A JSON value, as the cell made it. */
  json?: unknown;
  javascript?: string;
  chart?: unknown;
  /** A MIME value was left out for its size. */
  truncated: boolean;
  /** MIME types the cell produced that have no field here. */
  otherTypes: string[];
  /** The formats present. */
  formats(): ResultFormat[];
  /** The PNG's bytes; throws (naming the formats there are) when there is none. */
  pngBytes(): Uint8Array;
}

/** An exception the cell raised (or the kernel's death, or the timeout). */
export interface ExecutionError {
  name: string;
  value: string;
  traceback: string;
}

/** Why a cell ended. */
export type CodeReason = "finished" | "error" | "timeout" | "interrupted" | "context_died";

/** A cell's answer. An exception in the cell is an `error` here, never a thrown error. */
export interface Execution {
  stdout: string;
  stderr: string;
  stdoutTruncated: boolean;
  stderrTruncated: boolean;
  results: CodeResult[];
  error: ExecutionError | null;
  reason: CodeReason;
  executionCount: number | null;
  /** The context it ran in. */
  context: string;
  timings: { queueMs?: number; runMs?: number; totalMs?: number };
  /** The text of the cell's value, when it had one. */
  text: string | null;
}

/** One piece of a streamed cell, then its Execution last. */
export type CodeEvent =
  | { type: "stdout" | "stderr"; text: string }
  | { type: "result"; result: CodeResult }
  | { type: "error"; error: ExecutionError }
  | { type: "execution"; execution: Execution };

/** A context as the server describes it. */
export interface CodeContextInfo {
  id: string;
  language: string;
  cwd?: string;
  createdAt?: string;
  [more: string]: unknown;
}

export interface RunCodeOptions {
  /** The context's id; default: the sandbox's default context of `language`. */
  context?: string;
  /** Default "python". */
  language?: string;
  /** The cell is interrupted after this long (default 60 000); its state is kept. */
  timeoutMs?: number;
  /** Set in `os.environ` for this cell only. */
  env?: Record<string, string>;
  /** Output kept per stream (default 65 536), head and tail. */
  maxOutputBytes?: number;
  /** Aborting it closes the call (a streamed cell's stream too). */
  signal?: AbortSignal;
  /** Streamed output as it comes (the call streams when any callback is given). */
  onStdout?: (text: string) => void;
  onStderr?: (text: string) => void;
  onResult?: (result: CodeResult) => void;
}

export interface CreateContextOptions {
  /** Default "python" (the only kernel of the `code-interpreter` template). */
  language?: string;
  /** Its working directory (default the user's home). */
  cwd?: string;
  env?: Record<string, string>;
}

function str(v: unknown): string | undefined {
  return typeof v === "string" ? v : undefined;
}

export function codeResult(w: Record<string, unknown>): CodeResult {
  const r: CodeResult = {
    isMainResult: Boolean(w["is_main_result"]),
    truncated: Boolean(w["truncated"]),
    otherTypes: Array.isArray(w["other_types"]) ? (w["other_types"] as string[]) : [],
    formats: () => RESULT_FORMATS.filter((f) => r[f] !== undefined && r[f] !== null),
    pngBytes: () => {
      if (!r.png) throw new TypeError(`this result has no PNG (its formats: ${r.formats().join(", ") || "none"})`);
      return b64decode(r.png);
    },
  };
  for (const f of RESULT_FORMATS) {
    const v = w[f];
    if (v === undefined || v === null) continue;
    if (f === "json" || f === "chart") r[f] = v;
    else r[f] = str(v) ?? JSON.stringify(v);
  }
  return r;
}

function executionError(w: unknown): ExecutionError | null {
  if (!w || typeof w !== "object") return null;
  const e = w as Record<string, unknown>;
  return { name: String(e["name"] ?? ""), value: String(e["value"] ?? ""), traceback: String(e["traceback"] ?? "") };
}

export function execution(w: Record<string, unknown>): Execution {
  const results = Array.isArray(w["results"]) ? (w["results"] as Record<string, unknown>[]).map(codeResult) : [];
  const t = (w["timings"] ?? {}) as Record<string, number>;
  return {
    stdout: String(w["stdout"] ?? ""),
    stderr: String(w["stderr"] ?? ""),
    stdoutTruncated: Boolean(w["stdout_truncated"]),
    stderrTruncated: Boolean(w["stderr_truncated"]),
    results,
    error: executionError(w["error"]),
    reason: (str(w["reason"]) ?? "finished") as CodeReason,
    executionCount: typeof w["execution_count"] === "number" ? w["execution_count"] : null,
    context: String(w["context"] ?? ""),
    timings: { queueMs: t["queue_ms"], runMs: t["run_ms"], totalMs: t["total_ms"] },
    text: results.find((r) => r.isMainResult)?.text ?? null,
  };
}

function contextInfo(w: Record<string, unknown>): CodeContextInfo {
  const { created_at, ...rest } = w;
  return { ...rest, createdAt: str(created_at) } as CodeContextInfo;
}

function cellBody(code: string, opts: RunCodeOptions): Record<string, unknown> {
  if (typeof code !== "string") throw new TypeError("code is a string of source");
  const body: Record<string, unknown> = { code, language: opts.language ?? "python" };
  if (opts.context !== undefined) body["context"] = opts.context;
  if (opts.timeoutMs !== undefined) body["timeout_ms"] = opts.timeoutMs;
  if (opts.env !== undefined) body["env"] = opts.env;
  if (opts.maxOutputBytes !== undefined) body["max_output_bytes"] = opts.maxOutputBytes;
  return body;
}

/** A cell's events as they come; the last is `{ type: "execution" }`. */
export async function* streamCode(
  t: Transport,
  sandboxId: string,
  code: string,
  opts: RunCodeOptions,
): AsyncGenerator<CodeEvent, void, undefined> {
  const path = `/v1/sandboxes/${seg(sandboxId)}/code`;
  for await (const ev of t.ndjson("POST", path, { body: cellBody(code, opts), signal: opts.signal })) {
    switch (ev["type"]) {
      case "stdout":
      case "stderr":
        yield { type: ev["type"], text: String(ev["text"] ?? "") };
        break;
      case "result":
        yield { type: "result", result: codeResult(ev) };
        break;
      case "error":
        yield { type: "error", error: executionError(ev)! };
        break;
      case "execution":
        yield { type: "execution", execution: execution(ev) };
        return;
    }
  }
}

/** Runs one cell: its Execution (streamed to the callbacks when any is given). */
export async function runCode(t: Transport, sandboxId: string, code: string, opts: RunCodeOptions): Promise<Execution> {
  if (!opts.onStdout && !opts.onStderr && !opts.onResult) {
    const path = `/v1/sandboxes/${seg(sandboxId)}/code`;
    return execution(await t.json("POST", path, { body: cellBody(code, opts), signal: opts.signal }));
  }
  for await (const ev of streamCode(t, sandboxId, code, opts)) {
    if (ev.type === "stdout") opts.onStdout?.(ev.text);
    else if (ev.type === "stderr") opts.onStderr?.(ev.text);
    else if (ev.type === "result") opts.onResult?.(ev.result);
    else if (ev.type === "execution") return ev.execution;
  }
  throw new ConnectionError(0, "unreachable", "the cell's stream ended before its execution");
}

/** One kernel of a sandbox: variables and imports persist between its cells. */
export class CodeContext {
  readonly id: string;
  readonly language: string;
  /** What the server said about it last. */
  info: CodeContextInfo;
  private readonly base: string;

  /** @internal */
  constructor(
    private readonly t: Transport,
    readonly sandboxId: string,
    wire: Record<string, unknown>,
  ) {
    this.info = contextInfo(wire);
    this.id = this.info.id;
    this.language = this.info.language ?? "python";
    this.base = `/v1/sandboxes/${seg(sandboxId)}/contexts/${seg(this.id)}`;
  }

  /** @internal */
  static async create(t: Transport, sandboxId: string, opts: CreateContextOptions = {}): Promise<CodeContext> {
    const body: Record<string, unknown> = { language: opts.language ?? "python" };
    if (opts.cwd !== undefined) body["cwd"] = opts.cwd;
    if (opts.env !== undefined) body["env"] = opts.env;
    return new CodeContext(t, sandboxId, await t.json("POST", `/v1/sandboxes/${seg(sandboxId)}/contexts`, { body }));
  }

  /** @internal */
  static async list(t: Transport, sandboxId: string): Promise<CodeContext[]> {
    const d = await t.json<{ contexts: Record<string, unknown>[] }>("GET", `/v1/sandboxes/${seg(sandboxId)}/contexts`);
    return (d.contexts ?? []).map((w) => new CodeContext(t, sandboxId, w));
  }

  /** Runs a cell here. */
  runCode(code: string, opts: Omit<RunCodeOptions, "context" | "language"> = {}): Promise<Execution> {
    return runCode(this.t, this.sandboxId, code, { ...opts, context: this.id, language: this.language });
  }

  /** Runs a cell here, its output as it comes; the last event is its Execution. */
  runCodeStream(code: string, opts: Omit<RunCodeOptions, "context" | "language"> = {}): AsyncGenerator<CodeEvent, void, undefined> {
    return streamCode(this.t, this.sandboxId, code, { ...opts, context: this.id, language: this.language });
  }

  /** Interrupts the running cell (state kept); whether one was running. */
  async interrupt(): Promise<boolean> {
    const d = await this.t.json<{ interrupted: boolean }>("POST", `${this.base}/interrupt`);
    return Boolean(d.interrupted);
  }

  /** A new kernel: variables and imports are gone. */
  async restart(): Promise<CodeContextInfo> {
    this.info = contextInfo(await this.t.json("POST", `${this.base}/restart`));
    return this.info;
  }

  /** Ends its kernel. */
  async delete(): Promise<void> {
    await this.t.json("DELETE", this.base);
  }

  /** `await using ctx = await sbx.createCodeContext()` deletes it at the end of the block. */
  async [asyncDispose](): Promise<void> {
    try {
      await this.delete();
    } catch (e) {
      if (!(e instanceof NotFound)) throw e;
    }
  }
}
