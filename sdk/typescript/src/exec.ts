/**
 * Commands: the exec body shared by sandbox execs, background processes and serverless
 * runs, and background processes themselves (start, list, follow output, stdin, signal,
 * wait). The command is an argument list (`["python3", "x.py"]`, run as is) or one string
 * (run by `/bin/sh -c`).
 */

import { seg, type Transport } from "./transport.js";
import { b64encode, camel, execResult, streamEvent, type ExecResult, type ProcessInfo, type StreamEvent } from "./types.js";
import { ConnectionError } from "./errors.js";

/** An argument list, run as is, or a command line for `/bin/sh -c`. */
export type Command = readonly string[] | string;

export interface ExecOptions {
  /** Working directory (absolute); default the sandbox's `workdir`, else the user's home. */
  cwd?: string;
  env?: Record<string, string>;
  /**
   * Input for the command: text or bytes travel in the call (at most 768 KiB); a stream or
   * an async iterable of bytes is fed as it comes (any size, endless too), each chunk one
   * write, through a background process (`exec` only).
   */
  stdin?: string | Uint8Array | ReadableStream<Uint8Array> | AsyncIterable<Uint8Array>;
  /** Killed after this long (default 60 000; at most 1 h): the result says `timedOut: true`. */
  timeoutMs?: number;
  /** Output kept per stream (default 65 536); the rest goes to `outputPath`. */
  maxOutputBytes?: number;
  user?: string;
  /** Aborting it closes the call, which kills the command. */
  signal?: AbortSignal;
}

/** The API's exec body for `cmd` with `opts` (everything but `signal`). */
export function execBody(cmd: Command, opts: ExecOptions, defaultCwd?: string): Record<string, unknown> {
  const body: Record<string, unknown> = {};
  if (typeof cmd === "string") {
    body["shell"] = cmd;
  } else if (Array.isArray(cmd) && cmd.length > 0 && cmd.every((a) => typeof a === "string")) {
    body["cmd"] = [...cmd];
  } else {
    throw new TypeError("a command is a non-empty list of strings, or one string for /bin/sh -c");
  }
  const cwd = opts.cwd ?? defaultCwd;
  if (cwd !== undefined) body["cwd"] = cwd;
  if (opts.env !== undefined) body["env"] = opts.env;
  if (typeof opts.stdin === "string") body["stdin"] = opts.stdin;
  else if (opts.stdin instanceof Uint8Array) body["stdin_b64"] = b64encode(opts.stdin);
  else if (opts.stdin !== undefined) {
    throw new TypeError("a streamed stdin is taken by Sandbox.exec only; here give text or bytes, or write a process's stdin");
  }
  if (opts.timeoutMs !== undefined) body["timeout_ms"] = opts.timeoutMs;
  if (opts.maxOutputBytes !== undefined) body["max_output_bytes"] = opts.maxOutputBytes;
  if (opts.user !== undefined) body["user"] = opts.user;
  return body;
}

/** Streams a command's output; the result is the last event. */
/** Whether `stdin` is to be fed as it comes rather than sent in the call. */
export function isFed(stdin: ExecOptions["stdin"]): stdin is ReadableStream<Uint8Array> | AsyncIterable<Uint8Array> {
  return stdin !== undefined && typeof stdin !== "string" && !(stdin instanceof Uint8Array);
}

async function* chunksOf(src: ReadableStream<Uint8Array> | AsyncIterable<Uint8Array>): AsyncGenerator<Uint8Array> {
  if (typeof ReadableStream !== "undefined" && src instanceof ReadableStream) {
    const reader = src.getReader();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        yield value;
      }
    } finally {
      await reader.cancel().catch(() => undefined);
    }
  } else {
    yield* src as AsyncIterable<Uint8Array>;
  }
}

/**
 * An exec whose stdin is a stream: the command runs as a background process (with the
 * exec's timeout, 60 s unless given), is fed chunk by chunk while its result is awaited,
 * and is killed if `signal` aborts. Feeding stops when the command ends, even if the
 * source has more (`head -1` of an endless source returns at once).
 */
export async function execFed(processes: Processes, cmd: Command, opts: ExecOptions): Promise<ExecResult> {
  const { stdin, signal, ...rest } = opts;
  if (!isFed(stdin)) throw new TypeError("execFed takes a streamed stdin");
  signal?.throwIfAborted();
  const p = await processes.start(cmd, { ...rest, timeoutMs: rest.timeoutMs ?? 60_000 });
  const kill = () => void p.kill().catch(() => undefined);
  signal?.addEventListener("abort", kill, { once: true });
  let ended = false;
  const feed = (async () => {
    const source = chunksOf(stdin);
    try {
      for await (const chunk of source) {
        if (ended) break;
        if (chunk.length) await p.writeStdin(chunk);
      }
      if (!ended) await p.writeStdin(new Uint8Array(0), { close: true });
    } catch {
      // A write after the command stopped reading (it ended, or closed its stdin) fails;
      // the command's result, awaited below, is what the caller needs to see.
    } finally {
      await source.return(undefined);
    }
  })();
  try {
    return await p.wait({ signal });
  } finally {
    ended = true;
    signal?.removeEventListener("abort", kill);
    if (signal?.aborted) kill();
    await feed;
  }
}

export async function* streamCommand(
  t: Transport,
  method: string,
  path: string,
  body: Record<string, unknown> | undefined,
  signal?: AbortSignal,
): AsyncGenerator<StreamEvent, void, undefined> {
  for await (const ev of t.ndjson(method, path, { body, signal })) {
    yield streamEvent(ev);
  }
}

/** A background process of a sandbox. */
export class Process {
  readonly id: string;
  readonly pid: number | undefined;
  private readonly base: string;

  /** @internal */
  constructor(
    private readonly t: Transport,
    sandboxId: string,
    id: string,
    pid?: number,
  ) {
    this.id = id;
    this.pid = pid;
    this.base = `/v1/sandboxes/${seg(sandboxId)}/processes/${seg(id)}`;
  }

  /** Its state now; `result` once it ended. */
  async info(): Promise<ProcessInfo> {
    return processInfo(await this.t.json("GET", this.base));
  }

  /**
   * Its output from the start; with `follow` (the default) also as it comes, until it ends
   * (the last event is then its result). Breaking out or aborting only stops following.
   */
  output(opts: { follow?: boolean; signal?: AbortSignal } = {}): AsyncGenerator<StreamEvent, void, undefined> {
    const follow = opts.follow ?? true;
    return streamCommand(this.t, "GET", `${this.base}/output${follow ? "?follow=true" : ""}`, undefined, opts.signal);
  }

  /** Waits for it to end: its ExecResult. */
  async wait(opts: { signal?: AbortSignal } = {}): Promise<ExecResult> {
    for await (const ev of this.output({ follow: true, signal: opts.signal })) {
      if (ev.type === "result") return ev.result;
    }
    const info = await this.info();
    if (info.result) return info.result;
    throw new ConnectionError(0, "unreachable", `the output stream of ${this.id} ended without a result`);
  }

  /** Writes to its stdin; `close` closes it after this write. */
  async writeStdin(data: string | Uint8Array, opts: { close?: boolean } = {}): Promise<void> {
    const body = typeof data === "string" ? new TextEncoder().encode(data) : data;
    await this.t.json("POST", `${this.base}/stdin`, { body, query: { close: opts.close || undefined } });
  }

  /** Closes its stdin. */
  async closeStdin(): Promise<void> {
    await this.writeStdin(new Uint8Array(0), { close: true });
  }

  /** Sends a signal to its whole process tree (default SIGTERM). */
  async signal(signal = "SIGTERM"): Promise<void> {
    await this.t.json("POST", `${this.base}/signal`, { body: { signal } });
  }

  async kill(): Promise<void> {
    await this.signal("SIGKILL");
  }
}

export function processInfo(wire: unknown): ProcessInfo {
  const w = wire as Record<string, unknown>;
  const info = camel<ProcessInfo>({ ...w, result: undefined });
  info.result = w["result"] ? execResult(w["result"]) : null;
  return info;
}

/** Options of a background process: an exec's, but no timeout unless given. */
export type ProcessOptions = Omit<ExecOptions, "signal">;

/** The background processes of one sandbox. */
export class Processes {
  /** @internal */
  constructor(
    private readonly t: Transport,
    private readonly sandboxId: string,
    private readonly defaultCwd: () => string | undefined,
  ) {}

  /** Starts `cmd` and returns at once. */
  async start(cmd: Command, opts: ProcessOptions = {}): Promise<Process> {
    const d = await this.t.json<{ id: string; pid?: number }>("POST", `/v1/sandboxes/${seg(this.sandboxId)}/processes`, {
      body: execBody(cmd, opts, this.defaultCwd()),
    });
    return new Process(this.t, this.sandboxId, d.id, d.pid);
  }

  async list(): Promise<ProcessInfo[]> {
    const d = await this.t.json<{ processes: unknown[] }>("GET", `/v1/sandboxes/${seg(this.sandboxId)}/processes`);
    return (d.processes ?? []).map(processInfo);
  }

  /** A handle on process `id` (no call is made). */
  get(id: string): Process {
    return new Process(this.t, this.sandboxId, id);
  }
}
