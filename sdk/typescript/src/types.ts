/**
 * The API's objects as this package returns them: camelCase fields, typed, with the
 * conveniences a caller asks of a result (`timedOut`, `ok`, raw bytes). Also the reverse:
 * the options callers pass, turned into the API's snake_case bodies. Maps (`env`,
 * `metadata`) keep their keys as given, in both directions.
 *
 * Pure data: no I/O here.
 */

/** Keys whose values are user maps: their own keys are never renamed. */
const USER_MAPS = new Set(["metadata", "env", "labels"]);

function toCamel(k: string): string {
  return k.replace(/_([a-z0-9])/g, (_, c: string) => c.toUpperCase());
}

function toSnake(k: string): string {
  return k.replace(/[A-Z]/g, (c) => "_" + c.toLowerCase());
}

/** A wire object with camelCase keys, recursively, user maps left as they are. */
export function camel<T>(v: unknown): T {
  if (Array.isArray(v)) return v.map((x) => camel(x)) as T;
  if (v && typeof v === "object") {
    const out: Record<string, unknown> = {};
    for (const [k, x] of Object.entries(v)) {
      out[toCamel(k)] = USER_MAPS.has(k) ? x : camel(x);
    }
    return out as T;
  }
  return v as T;
}

/** An options object as the API's snake_case body; `undefined` fields are left out. */
export function snake(v: Record<string, unknown>): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [k, x] of Object.entries(v)) {
    if (x === undefined) continue;
    const key = toSnake(k);
    out[key] =
      USER_MAPS.has(key) || !x || typeof x !== "object" || Array.isArray(x) || x instanceof Uint8Array
        ? x
        : snake(x as Record<string, unknown>);
  }
  return out;
}

export function b64encode(bytes: Uint8Array): string {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(s);
}

export function b64decode(s: string): Uint8Array {
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

/** How a command ended. */
export type Reason = "exited" | "signaled" | "timeout" | "oom" | "output_limit" | "killed";

export interface Timings {
  queueMs: number;
  startMs: number;
  runMs: number;
  totalMs: number;
}

/** What a run on a volume changed, and whether it was applied. */
export interface Changes {
  added: string[];
  modified: string[];
  deleted: string[];
  committed: boolean;
  conflicts: string[];
  /** Why changes that were to be applied were not (the volume's size). */
  commitError?: string | null;
}

/** The result of every exec, run and ended background process. */
export interface ExecResult {
  callId: string;
  /** null when there is no exit code (signal, timeout, oom). */
  exitCode: number | null;
  signal: string | null;
  reason: Reason;
  stdout: string;
  stderr: string;
  /** The kept stdout bytes in base64, only when they are not valid UTF-8. */
  stdoutB64: string | null;
  stderrB64: string | null;
  stdoutTruncated: boolean;
  stderrTruncated: boolean;
  stdoutBytes: number;
  stderrBytes: number;
  /** When truncated: a file in the sandbox or volume with the full output. */
  outputPath: string | null;
  timings: Timings;
  usage: { cpuMs: number; peakMemoryBytes: number };
  changes: Changes | null;
  /** The command ran past its `timeoutMs` and was killed (its output so far is kept). */
  timedOut: boolean;
  /** It exited with 0. */
  ok: boolean;
  /** The exact stdout bytes kept (the text's bytes unless it was not UTF-8). */
  stdoutRaw(): Uint8Array;
  stderrRaw(): Uint8Array;
}

export function execResult(wire: unknown): ExecResult {
  const r = camel<Omit<ExecResult, "timedOut" | "ok" | "stdoutRaw" | "stderrRaw">>(wire);
  const raw = (b64: string | null | undefined, text: string) =>
    b64 ? b64decode(b64) : new TextEncoder().encode(text ?? "");
  return {
    ...r,
    stdoutB64: r.stdoutB64 ?? null,
    stderrB64: r.stderrB64 ?? null,
    changes: r.changes ?? null,
    timedOut: r.reason === "timeout",
    ok: r.exitCode === 0,
    stdoutRaw: () => raw(r.stdoutB64, r.stdout),
    stderrRaw: () => raw(r.stderrB64, r.stderr),
  };
}

/** One piece of a streamed command's output, or its end. */
export type StreamEvent =
  | {
      type: "stdout" | "stderr";
      /** The chunk as text (lossy when it is not UTF-8). */
      data: string;
      /** The chunk's exact bytes. */
      bytes(): Uint8Array;
    }
  | { type: "result"; result: ExecResult }
  /** A background process's state change, in its output stream. */
  | { type: "state"; state: string };

export function streamEvent(ev: Record<string, unknown>): StreamEvent {
  if (ev["type"] === "result") return { type: "result", result: execResult(ev) };
  if (ev["type"] === "state") return { type: "state", state: String(ev["state"] ?? "") };
  const data = String(ev["data"] ?? "");
  const b64 = ev["data_b64"] as string | undefined;
  return {
    type: ev["type"] === "stderr" ? "stderr" : "stdout",
    data,
    bytes: () => (b64 ? b64decode(b64) : new TextEncoder().encode(data)),
  };
}

/** The `network` policy: the API's form, or the shorthand `{ internet: boolean }`. */
export type Network =
  | { egress: "none" }
  | { egress: "all" }
  | { egress: "allow"; allow: string[] }
  | { internet: boolean }
  | { allow: string[] };

/** The API's form of a policy (the shorthands: `internet: false` = none, `true` = all, `allow: […]` alone = allow). */
export function wireNetwork(n: Network | undefined): Record<string, unknown> | undefined {
  if (n === undefined) return undefined;
  if ("egress" in n) return n as Record<string, unknown>;
  if ("internet" in n) return { egress: n.internet ? "all" : "none" };
  return { egress: "allow", allow: n.allow };
}

export type SandboxState = "starting" | "running" | "paused" | "stopped" | "failed";

export interface VolumeMount {
  volume: string;
  path?: string;
  readOnly?: boolean;
}

/** A sandbox as the server describes it. */
export interface SandboxInfo {
  id: string;
  state: SandboxState;
  template: string;
  templateDigest?: string;
  runtime: string;
  cpus: number;
  memoryMb: number;
  diskMb: number;
  network: { egress: string; allow?: string[] };
  volumes: VolumeMount[];
  metadata: Record<string, string>;
  createdAt: string;
  expiresAt: string;
  lastActiveAt: string | null;
  ttlS?: number;
  idleTimeoutS?: number | null;
  usage?: Record<string, number>;
  failure: string | null;
  previewToken?: string;
  /** A template with `{port}`; null without a preview domain. */
  previewUrl?: string | null;
  [more: string]: unknown;
}

/** A file, directory or link in a sandbox or volume. */
export interface Entry {
  path: string;
  name: string;
  type: "file" | "dir" | "symlink" | string;
  size: number;
  mode: number;
  mtime: string;
  [more: string]: unknown;
}

export interface Snapshot {
  id: string;
  sandboxId: string;
  template: string;
  runtime: string;
  sizeBytes: number;
  hasMemory: boolean;
  createdAt: string;
}

export interface VolumeInfo {
  id: string;
  name: string;
  sizeMb: number;
  usedBytes: number;
  createdAt: string;
  [more: string]: unknown;
}

export interface VolumeSnapshot {
  id: string;
  volumeId: string;
  sizeBytes: number;
  createdAt: string;
}

/** A TCP port listening in a sandbox. */
export interface Port {
  port: number;
  address: string;
  process: string | null;
  pid: number | null;
  public: boolean;
  /** The preview URL, or the path proxy's URL without a preview domain. */
  url: string;
  /** The path proxy's URL (reached with the API key). */
  proxyUrl: string;
  [more: string]: unknown;
}

/** The record of one exec or run (never its output bodies, never env values). */
export interface CallRecord {
  /** The call's id (the ExecResult's `callId`). */
  id: string;
  /** "exec", "run", "process", … */
  kind: string;
  /** The argument list (`["/bin/sh", "-c", …]` for a shell line). */
  command: string[];
  cwd: string | null;
  /** The names of the env variables it was given (never their values). */
  envKeys: string[];
  sandboxId: string | null;
  volumeId: string | null;
  runtime: string;
  templateDigest: string | null;
  keyId: string | null;
  createdAt: string;
  /** Names or addresses its egress policy refused. */
  egressDenied: string[];
  /** Its ExecResult without the output bodies; null while it runs. */
  result: Record<string, unknown> | null;
  changes: Changes | null;
  [more: string]: unknown;
}

/** The per-tenant totals of `GET /v1/usage`. */
export interface Usage {
  cpuMs: number;
  sandboxSeconds: number;
  runs: number;
  execs: number;
  [more: string]: unknown;
}

/** A background process as listed or described. */
export interface ProcessInfo {
  id: string;
  pid?: number;
  /** "running" or "exited". */
  state?: string;
  argv?: string[];
  startedAt?: string;
  /** Its ExecResult once it ended. */
  result?: ExecResult | null;
  [more: string]: unknown;
}

/** What a sandbox made from a template gets (an imported image's config says the same). */
export interface TemplateRunConfig {
  env?: Record<string, string>;
  workdir?: string | null;
  user?: string | null;
  startCmd?: string | string[] | null;
  readyCmd?: string | null;
  exposedPorts?: number[];
  labels?: Record<string, string>;
}

/** A template: the tenant's own, or the shared `default` and `code-interpreter`. */
export interface TemplateInfo extends TemplateRunConfig {
  name: string;
  digest: string;
  sizeBytes: number;
  createdAt: string;
  packages: string[];
  /** On an imported image's answer: the image's run config. */
  config?: TemplateRunConfig;
  [more: string]: unknown;
}
