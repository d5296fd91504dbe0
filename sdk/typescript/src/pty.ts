/**
 * A terminal in a sandbox: `GET /v1/sandboxes/{id}/pty` upgraded to a WebSocket. Binary
 * frames carry the terminal's bytes both ways; `{"resize":[cols,rows]}` resizes it; the
 * server's last text frame `{"type":"exit", …ExecResult}` says how the program ended.
 *
 * The route needs the API key in an `Authorization` header, which the standard browser
 * `WebSocket` cannot send; Node's (undici: Node 22+, or 20.10+ with
 * `--experimental-websocket`) and Bun's take `{ headers }`, as does the `ws` package, which
 * can be passed as `webSocket`. Without one, `pty()` rejects saying so.
 */

import { execResult, type ExecResult } from "./types.js";
import { LockerError } from "./errors.js";
import type { Transport } from "./transport.js";

/** A WebSocket constructor that takes `{ headers }` as its second argument. */
export type WebSocketLike = new (url: string, init?: { headers?: Record<string, string> }) => WebSocket;

export interface PtyOptions {
  cols?: number;
  rows?: number;
  /** The program, run by `/bin/sh -c` (default: a login shell). */
  cmd?: string;
  /** A WebSocket implementation to use instead of the global one. */
  webSocket?: WebSocketLike;
}

/** An open terminal: iterate over its output; `exited` resolves when its program ends. */
export class Pty implements AsyncIterable<Uint8Array> {
  /** The program's result (null when the connection ended without one). */
  readonly exited: Promise<ExecResult | null>;
  private readonly chunks: Uint8Array[] = [];
  private wake: (() => void) | undefined;
  private closed = false;

  /** @internal */
  constructor(private readonly ws: WebSocket) {
    ws.binaryType = "arraybuffer";
    let settle: (r: ExecResult | null) => void = () => undefined;
    this.exited = new Promise((r) => (settle = r));
    let result: ExecResult | null = null;
    ws.addEventListener("message", (m: MessageEvent) => {
      if (typeof m.data === "string") {
        try {
          const v = JSON.parse(m.data) as Record<string, unknown>;
          if (v["type"] === "exit") result = execResult(v);
        } catch {
          // Only the exit frame is JSON; anything else is not for us.
        }
      } else {
        this.chunks.push(new Uint8Array(m.data as ArrayBuffer));
      }
      this.wake?.();
    });
    ws.addEventListener("close", () => {
      this.closed = true;
      settle(result);
      this.wake?.();
    });
  }

  /** Types `data` into the terminal. */
  write(data: string | Uint8Array): void {
    this.ws.send(typeof data === "string" ? new TextEncoder().encode(data) : data);
  }

  resize(cols: number, rows: number): void {
    this.ws.send(JSON.stringify({ resize: [cols, rows] }));
  }

  /** Closes the terminal (the program is killed). */
  close(): void {
    this.ws.close();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<Uint8Array> {
    for (;;) {
      const next = this.chunks.shift();
      if (next) {
        yield next;
        continue;
      }
      if (this.closed) return;
      await new Promise<void>((r) => (this.wake = r));
      this.wake = undefined;
    }
  }
}

/** Opens a terminal in sandbox path `base` (`/v1/sandboxes/{id}`). */
export async function openPty(t: Transport, base: string, opts: PtyOptions): Promise<Pty> {
  const WS = opts.webSocket ?? (globalThis as { WebSocket?: WebSocketLike }).WebSocket;
  if (!WS) {
    throw new LockerError(
      0,
      "unsupported",
      "this runtime has no WebSocket: use Node 22+ (or 20.10+ with --experimental-websocket), Bun, or pass `webSocket` (the ws package)",
    );
  }
  const url = t.href(`${base}/pty`, { cols: opts.cols, rows: opts.rows, cmd: opts.cmd }).replace(/^http/, "ws");
  const ws = new WS(url, { headers: t.apiKey ? { Authorization: `Bearer ${t.apiKey}` } : {} });
  const pty = new Pty(ws);
  await new Promise<void>((resolve, reject) => {
    ws.addEventListener("open", () => resolve(), { once: true });
    ws.addEventListener(
      "error",
      () => reject(new LockerError(0, "unreachable", `the terminal of ${base} could not be opened (a wrong key or sandbox answers 401 or 404)`)),
      { once: true },
    );
  });
  return pty;
}
