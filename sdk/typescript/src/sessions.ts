/**
 * One sandbox per agent session, for workers that serve a hosted agent loop's tool calls
 * (Claude Managed Agents' custom tools, OpenAI Agents API sessions, any loop that runs
 * elsewhere and sends its tool calls here): the session's first call makes its sandbox,
 * later calls reuse it — also from another worker process or after a restart, since the
 * sandbox carries the session id in its metadata — and `end` deletes it. Sandboxes of
 * sessions that simply stop calling are reclaimed by Locker itself (`idleTimeoutSeconds`
 * pauses them, `ttlSeconds` destroys them).
 *
 * Owns no route: it uses `Sandbox.create`/`list`.
 */

import { Sandbox, type CreateOptions } from "./sandbox.js";
import { NotFound } from "./errors.js";
import type { ClientOptions } from "./transport.js";

/** The metadata key that names a sandbox's session. */
export const SESSION_KEY = "locker-session";

export class SessionSandboxes {
  private readonly live = new Map<string, Promise<Sandbox>>();

  /** `create`: how each session's sandbox is made (default: no network, 2 h TTL). */
  constructor(
    private readonly create: CreateOptions & ClientOptions = {},
  ) {}

  private conn(): ClientOptions {
    return { url: this.create.url, apiKey: this.create.apiKey, fetch: this.create.fetch };
  }

  /** The session's sandbox: this worker's, else one another worker made, else a new one. */
  get(sessionId: string): Promise<Sandbox> {
    if (!sessionId) throw new TypeError("a session id is required");
    let p = this.live.get(sessionId);
    if (!p) {
      p = this.find(sessionId);
      this.live.set(sessionId, p);
      p.catch(() => this.live.delete(sessionId));
    }
    return p;
  }

  private async find(sessionId: string): Promise<Sandbox> {
    const workdir = this.create.workdir === undefined ? "/workspace" : (this.create.workdir ?? undefined);
    for (const s of await Sandbox.list({ metadata: { [SESSION_KEY]: sessionId } }, this.conn())) {
      if (s.state === "running" || s.state === "paused" || s.state === "starting") {
        if (s.state === "paused") await s.resume();
        s.workdir = workdir;
        return s;
      }
    }
    return Sandbox.create({
      network: { internet: false },
      ttlSeconds: 7200,
      ...this.create,
      metadata: { ...this.create.metadata, [SESSION_KEY]: sessionId },
    });
  }

  /** The session ended: its sandbox is deleted (wherever it was made). */
  async end(sessionId: string): Promise<void> {
    const mine = this.live.get(sessionId);
    this.live.delete(sessionId);
    const all = await Sandbox.list({ metadata: { [SESSION_KEY]: sessionId } }, this.conn());
    const ids = new Set(all.map((s) => s.id));
    if (mine) ids.add((await mine.catch(() => undefined))?.id ?? "");
    ids.delete("");
    for (const id of ids) {
      await Sandbox.get(id, {}, this.conn())
        .then((s) => s.delete())
        .catch((e: unknown) => {
          if (!(e instanceof NotFound)) throw e;
        });
    }
  }

  /** The sessions this worker holds a sandbox for. */
  sessions(): string[] {
    return [...this.live.keys()];
  }
}
