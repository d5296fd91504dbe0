/**
 * The client: one server and one API key, with the tenant's collections (sandboxes,
 * volumes, secrets, snapshots, templates) and the account-wide reads (call records, usage, health).
 */

import { Transport, type ClientOptions } from "./transport.js";
import { Sandbox, type CreateOptions, type ListFilter } from "./sandbox.js";
import { Volumes, runBody, type RunOptions } from "./volume.js";
import { Secrets } from "./secret.js";
import { Templates } from "./template.js";
import type { Command } from "./exec.js";
import { camel, execResult, type CallRecord, type ExecResult, type Snapshot, type Usage } from "./types.js";
import { seg } from "./transport.js";

export class Client {
  /** @internal */
  readonly transport: Transport;
  readonly sandboxes: {
    create(opts?: CreateOptions): Promise<Sandbox>;
    get(id: string, opts?: { workdir?: string }): Promise<Sandbox>;
    list(filter?: ListFilter): Promise<Sandbox[]>;
    delete(id: string): Promise<void>;
  };
  readonly volumes: Volumes;
  /** Values a machine's code uses but never sees (never returned by any call). */
  readonly secrets: Secrets;
  readonly snapshots: {
    list(): Promise<Snapshot[]>;
    delete(id: string): Promise<void>;
  };
  /** Templates: list, get, delete, build (Dockerfile, template, image, packages) and image import. */
  readonly templates: Templates;

  /** `url` defaults to `$LOCKER_URL` (else http://127.0.0.1:7070), `apiKey` to `$LOCKER_API_KEY`. */
  constructor(opts: ClientOptions = {}) {
    const t = new Transport(opts);
    this.transport = t;
    const conn = { transport: t };
    this.sandboxes = {
      create: (o = {}) => Sandbox.create(o, conn),
      get: (id, o = {}) => Sandbox.get(id, o, conn),
      list: (f = {}) => Sandbox.list(f, conn),
      delete: async (id) => {
        await t.json("DELETE", `/v1/sandboxes/${seg(id)}`);
      },
    };
    this.volumes = new Volumes(t);
    this.secrets = new Secrets(t);
    this.snapshots = {
      list: async () => camel<Snapshot[]>((await t.json<{ snapshots: unknown[] }>("GET", "/v1/snapshots")).snapshots),
      delete: async (id) => {
        await t.json("DELETE", `/v1/snapshots/${seg(id)}`);
      },
    };
    this.templates = new Templates(t);
  }

  get url(): string {
    return this.transport.url;
  }

  /** A serverless run on `volume` (its id or name) in one call; see `Volume.run`. */
  async run(volume: string, cmd: Command, opts: RunOptions = {}): Promise<ExecResult> {
    const wire = await this.transport.json("POST", `/v1/volumes/${seg(volume)}/run`, {
      body: runBody(cmd, opts),
      signal: opts.signal,
    });
    return execResult(wire);
  }

  /** Call records (every exec and run), newest first; `volumeId` takes a volume's name too. */
  async calls(filter: { sandboxId?: string; volumeId?: string; limit?: number } = {}): Promise<CallRecord[]> {
    const d = await this.transport.json<{ calls: unknown[] }>("GET", "/v1/calls", {
      query: { sandbox_id: filter.sandboxId, volume_id: filter.volumeId, limit: filter.limit },
    });
    return camel<CallRecord[]>(d.calls);
  }

  /** The tenant's totals since `since` (an RFC 3339 time or a Date). */
  async usage(opts: { since?: string | Date } = {}): Promise<Usage> {
    const since = opts.since instanceof Date ? opts.since.toISOString() : opts.since;
    return camel<Usage>(await this.transport.json("GET", "/v1/usage", { query: { since } }));
  }

  /** `GET /healthz` (no key needed). */
  async health(): Promise<Record<string, unknown>> {
    return this.transport.json("GET", "/healthz");
  }
}

