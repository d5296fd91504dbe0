/**
 * The files API of a sandbox or a volume (the same routes under `/v1/sandboxes/{id}` and
 * `/v1/volumes/{id}`): read and write as text, bytes or streams; directories as tar
 * archives; list, stat, mkdir, move, remove. Bodies are streamed both ways, never held whole unless the caller asks for a
 * whole file (`read`, `readText`).
 */

import type { Transport } from "./transport.js";
import { camel, type Entry } from "./types.js";
import { NotFound } from "./errors.js";

/** What `write` takes: text (as UTF-8), bytes, a Blob, or a stream or async iterable of bytes. */
export type WriteData =
  | string
  | Uint8Array
  | ArrayBuffer
  | Blob
  | ReadableStream<Uint8Array>
  | AsyncIterable<Uint8Array>;

function toStream(it: AsyncIterable<Uint8Array>): ReadableStream<Uint8Array> {
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

function bodyOf(data: WriteData): BodyInit {
  if (typeof data === "string") return new TextEncoder().encode(data);
  if (data instanceof Uint8Array || data instanceof ArrayBuffer) return data as BodyInit;
  if (typeof Blob !== "undefined" && data instanceof Blob) return data;
  if (data instanceof ReadableStream) return data;
  return toStream(data as AsyncIterable<Uint8Array>);
}

export class Files {
  /** @internal */
  constructor(
    private readonly t: Transport,
    private readonly base: string,
  ) {}

  /** The file's bytes, whole. */
  async read(path: string, opts: { signal?: AbortSignal } = {}): Promise<Uint8Array> {
    const res = await this.t.send("GET", `${this.base}/files`, { query: { path }, signal: opts.signal });
    return new Uint8Array(await res.arrayBuffer());
  }

  /** The file as UTF-8 text (invalid bytes replaced). */
  async readText(path: string, opts: { signal?: AbortSignal } = {}): Promise<string> {
    return new TextDecoder().decode(await this.read(path, opts));
  }

  /** The file's bytes as they arrive (for large files). */
  async readStream(path: string, opts: { signal?: AbortSignal } = {}): Promise<ReadableStream<Uint8Array>> {
    const res = await this.t.send("GET", `${this.base}/files`, { query: { path }, signal: opts.signal });
    return res.body ?? new ReadableStream({ start: (c) => c.close() });
  }

  /** Writes (creates or replaces) a file, creating its parent directories; `mode` like 0o755 or "0755". */
  async write(path: string, data: WriteData, opts: { mode?: number | string; signal?: AbortSignal } = {}): Promise<Entry> {
    const body = bodyOf(data);
    const mode = typeof opts.mode === "number" ? opts.mode.toString(8).padStart(4, "0") : opts.mode;
    const wire = await this.t.json("PUT", `${this.base}/files`, { query: { path, mode }, body, signal: opts.signal });
    return camel<Entry>(wire);
  }

  /**
   * The directory `path` as a tar archive, streamed (files with their mode and mtime,
   * directories, symlinks as links; depth first, sorted).
   */
  async readTar(path: string, opts: { signal?: AbortSignal } = {}): Promise<ReadableStream<Uint8Array>> {
    const res = await this.t.send("GET", `${this.base}/files`, {
      query: { path, format: "tar" },
      headers: { Accept: "application/x-tar" },
      signal: opts.signal,
    });
    return res.body ?? new ReadableStream({ start: (c) => c.close() });
  }

  /**
   * Extracts a tar archive into the directory `path` (made with its parents if missing):
   * the directory's Entry with `entries` (written) and `bytes` (file data). An entry that
   * would leave the directory is refused (400), those before it stay.
   */
  async writeTar(path: string, archive: WriteData, opts: { signal?: AbortSignal } = {}): Promise<Entry & { entries: number; bytes: number }> {
    const wire = await this.t.json("PUT", `${this.base}/files`, {
      query: { path, format: "tar" },
      body: bodyOf(archive),
      headers: { "Content-Type": "application/x-tar" },
      signal: opts.signal,
    });
    return camel(wire);
  }

  /** The entries under `path` (`depth` levels down, default 1). */
  async list(path = "/", opts: { depth?: number } = {}): Promise<Entry[]> {
    const wire = await this.t.json<{ entries: unknown[] }>("GET", `${this.base}/files/list`, {
      query: { path, depth: opts.depth },
    });
    return camel<Entry[]>(wire.entries);
  }

  async stat(path: string): Promise<Entry> {
    return camel<Entry>(await this.t.json("GET", `${this.base}/files/stat`, { query: { path } }));
  }

  /** Whether `path` exists (a missing one is false; other errors are thrown). */
  async exists(path: string): Promise<boolean> {
    try {
      await this.stat(path);
      return true;
    } catch (e) {
      if (e instanceof NotFound) return false;
      throw e;
    }
  }

  /** Creates a directory and its parents. */
  async mkdir(path: string): Promise<Entry> {
    return camel<Entry>(await this.t.json("POST", `${this.base}/files/mkdir`, { body: { path } }));
  }

  /** Moves or renames `from` to `to`. */
  async move(from: string, to: string): Promise<Entry> {
    return camel<Entry>(await this.t.json("POST", `${this.base}/files/move`, { body: { from, to } }));
  }

  /** Removes a file, or a directory (`recursive: true` for one that is not empty). */
  async remove(path: string, opts: { recursive?: boolean } = {}): Promise<void> {
    await this.t.json("DELETE", `${this.base}/files`, { query: { path, recursive: opts.recursive } });
  }
}

