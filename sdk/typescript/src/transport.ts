/**
 * The HTTP transport: one Locker server, one API key, the platform's `fetch`. It owns
 * authentication, JSON bodies, the mapping of HTTP errors to typed errors, NDJSON streams,
 * and retries, which happen only where they are safe: a `GET` whose connection failed
 * before any answer arrived (twice more, after 100 and 400 ms). Nothing that creates,
 * changes or runs anything is ever sent twice.
 *
 * It knows no route of the API; the resource modules build paths and bodies.
 */

import { ConnectionError, errorFromEvent, errorFromResponse } from "./errors.js";

/** The server used when neither `url` nor `LOCKER_URL` says otherwise. */
export const DEFAULT_URL = "http://127.0.0.1:7070";

/** How to reach a Locker server. */
export interface ClientOptions {
  /** Base URL of the server; default `$LOCKER_URL`, else http://127.0.0.1:7070. */
  url?: string;
  /** API key; default `$LOCKER_API_KEY`. */
  apiKey?: string;
  /** A `fetch` to use instead of the global one (a proxy's, a test's). */
  fetch?: typeof fetch;
}

/** Query parameters; `undefined` and `null` are left out, booleans are `true`/`false`. */
export type Query = Record<string, string | number | boolean | undefined | null>;

/** One request's options. */
export interface RequestOptions {
  /** JSON (an object) or a raw body (bytes, a stream, a Blob). */
  body?: unknown;
  query?: Query;
  headers?: Record<string, string>;
  signal?: AbortSignal;
}

const RETRY_DELAYS_MS = [100, 400];

function env(name: string): string | undefined {
  const p = (globalThis as { process?: { env?: Record<string, string | undefined> } }).process;
  const v = p?.env?.[name];
  return v === "" ? undefined : v;
}

/** Whether `b` is sent as raw bytes rather than as JSON. */
function isRaw(b: unknown): b is BodyInit {
  return (
    typeof b === "string" ||
    b instanceof Uint8Array ||
    b instanceof ArrayBuffer ||
    (typeof Blob !== "undefined" && b instanceof Blob) ||
    (typeof ReadableStream !== "undefined" && b instanceof ReadableStream)
  );
}

/** A path segment, escaped (ids and names never need it; a hostile one must not escape its route). */
export function seg(s: string | number): string {
  return encodeURIComponent(String(s));
}

export class Transport {
  /** The server's base URL, without a trailing slash. */
  readonly url: string;
  readonly apiKey: string | undefined;
  private readonly fetchFn: typeof fetch;

  constructor(opts: ClientOptions = {}) {
    const url = (opts.url ?? env("LOCKER_URL") ?? DEFAULT_URL).replace(/\/+$/, "");
    let parsed: URL;
    try {
      parsed = new URL(url);
    } catch {
      throw new TypeError(`not an http(s) URL: ${JSON.stringify(url)}`);
    }
    if (parsed.protocol !== "http:" && parsed.protocol !== "https:") {
      throw new TypeError(`not an http(s) URL: ${JSON.stringify(url)}`);
    }
    this.url = url;
    this.apiKey = opts.apiKey ?? env("LOCKER_API_KEY");
    const f = opts.fetch ?? globalThis.fetch;
    if (typeof f !== "function") {
      throw new TypeError("no fetch in this runtime: use Node 18 or later, or pass `fetch`");
    }
    this.fetchFn = f.bind(globalThis);
  }

  /** The full URL of `path` with `query`. */
  href(path: string, query?: Query): string {
    let q = "";
    if (query) {
      const p = new URLSearchParams();
      for (const [k, v] of Object.entries(query)) {
        if (v !== undefined && v !== null) p.append(k, String(v));
      }
      const s = p.toString();
      if (s) q = "?" + s;
    }
    return this.url + path + q;
  }

  /** The answer of one call, its status checked (a typed error otherwise). */
  async send(method: string, path: string, opts: RequestOptions = {}): Promise<Response> {
    const headers: Record<string, string> = { Accept: "application/json" };
    if (this.apiKey) headers["Authorization"] = `Bearer ${this.apiKey}`;
    let body: BodyInit | undefined;
    let stream = false;
    if (opts.body !== undefined) {
      if (isRaw(opts.body)) {
        body = opts.body;
        headers["Content-Type"] = "application/octet-stream";
        stream = typeof ReadableStream !== "undefined" && opts.body instanceof ReadableStream;
      } else {
        body = JSON.stringify(opts.body);
        headers["Content-Type"] = "application/json";
      }
    }
    Object.assign(headers, opts.headers);
    const url = this.href(path, opts.query);
    const init: RequestInit & { duplex?: "half" } = { method, headers, body, signal: opts.signal };
    // A streamed request body needs half duplex in Node's fetch (and is never retried).
    if (stream) init.duplex = "half";
    const retries = method === "GET" ? RETRY_DELAYS_MS : [];
    for (let attempt = 0; ; attempt++) {
      let res: Response;
      try {
        res = await this.fetchFn(url, init);
      } catch (e) {
        if (opts.signal?.aborted) throw opts.signal.reason ?? e;
        if (attempt < retries.length) {
          await new Promise((r) => setTimeout(r, retries[attempt]));
          continue;
        }
        const why = e instanceof Error ? (e.cause instanceof Error ? e.cause.message : e.message) : String(e);
        throw new ConnectionError(0, "unreachable", `${method} ${url}: ${why}`, { cause: e });
      }
      if (res.status >= 400) {
        const raw = await res.text().catch(() => "");
        throw errorFromResponse(res.status, raw);
      }
      return res;
    }
  }

  /** A JSON call: the decoded answer, `undefined` for 204 or an empty body. */
  async json<T>(method: string, path: string, opts: RequestOptions = {}): Promise<T> {
    const res = await this.send(method, path, opts);
    let text: string;
    try {
      text = await res.text();
    } catch (e) {
      throw new ConnectionError(0, "unreachable", `${method} ${path}: reading the answer: ${String(e)}`, { cause: e });
    }
    return (text ? JSON.parse(text) : undefined) as T;
  }

  /**
   * An NDJSON stream's objects as they arrive. Ending the iteration early (`break`,
   * `return`, an aborted `signal`) closes the connection, which the server takes as
   * "kill the command". A `{"type":"error"}` line is thrown as a typed error.
   */
  async *ndjson(method: string, path: string, opts: RequestOptions = {}): AsyncGenerator<Record<string, unknown>> {
    const res = await this.send(method, path, {
      ...opts,
      headers: { ...opts.headers, Accept: "application/x-ndjson" },
    });
    if (!res.body) return;
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    let done = false;
    try {
      for (;;) {
        let chunk: ReadableStreamReadResult<Uint8Array>;
        try {
          chunk = await reader.read();
        } catch (e) {
          if (opts.signal?.aborted) throw opts.signal.reason ?? e;
          throw new ConnectionError(0, "unreachable", `${method} ${path}: the stream broke: ${String(e)}`, { cause: e });
        }
        if (chunk.done) {
          buf += decoder.decode();
        } else {
          buf += decoder.decode(chunk.value, { stream: true });
        }
        let nl: number;
        while ((nl = buf.indexOf("\n")) >= 0) {
          const line = buf.slice(0, nl).trim();
          buf = buf.slice(nl + 1);
          if (!line) continue;
          const ev = JSON.parse(line) as Record<string, unknown>;
          // A failure of the call itself: `{"type":"error","error":{code,message}}` (a code
          // cell's own exception is also `type: "error"`, with `name` and `value`: an event).
          if (ev["type"] === "error" && ev["error"] !== null && typeof ev["error"] === "object") {
            throw errorFromEvent(res.status, ev["error"] as { code?: unknown; message?: unknown });
          }
          yield ev;
        }
        if (chunk.done) {
          const rest = buf.trim();
          if (rest) yield JSON.parse(rest) as Record<string, unknown>;
          done = true;
          return;
        }
      }
    } finally {
      if (!done) await reader.cancel().catch(() => undefined);
      reader.releaseLock();
    }
  }
}

