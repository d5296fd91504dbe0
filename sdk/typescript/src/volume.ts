/**
 * Volumes (the persistent disk) and serverless runs on them: create, get, list, delete;
 * their files; snapshots, restore and forks; `run`, a fresh machine per call whose changes
 * are committed to the volume as the commit mode says, and listed in `changes`.
 *
 * Paths and bodies of `/v1/volumes…` live here.
 */

import { seg, type Transport } from "./transport.js";
import { Conflict, NotFound } from "./errors.js";
import { Files } from "./files.js";
import { execBody, streamCommand, type Command, type ExecOptions } from "./exec.js";
import {
  camel,
  execResult,
  wireNetwork,
  type ExecResult,
  type Network,
  type StreamEvent,
  type VolumeInfo,
  type VolumeSnapshot,
} from "./types.js";

/** When a run's changes are applied to the volume. */
export type CommitMode = "always" | "on_success" | "never";

export interface RunOptions extends ExecOptions {
  /** `always` (default: last writer wins, conflicts listed), `on_success` (exit 0 and no conflict), `never`. */
  commit?: CommitMode;
  /** Where the volume is mounted (default `/workspace`, also the default `cwd`). */
  mountPath?: string;
  template?: string;
  runtime?: "auto" | "jail" | "microvm";
  cpus?: number;
  memoryMb?: number;
  network?: Network;
  /** Secrets by name, as a sandbox's create takes them. */
  secrets?: string[];
}

/** The API's run body for `cmd` with `opts` (everything but `signal`). */
export function runBody(cmd: Command, o: RunOptions): Record<string, unknown> {
  const body = execBody(cmd, o);
  if (o.commit !== undefined) body["commit"] = o.commit;
  if (o.mountPath !== undefined) body["mount_path"] = o.mountPath;
  if (o.template !== undefined) body["template"] = o.template;
  if (o.runtime !== undefined) body["runtime"] = o.runtime;
  if (o.cpus !== undefined) body["cpus"] = o.cpus;
  if (o.memoryMb !== undefined) body["memory_mb"] = o.memoryMb;
  if (o.network !== undefined) body["network"] = wireNetwork(o.network);
  if (o.secrets !== undefined) body["secrets"] = o.secrets;
  return body;
}

/** One volume; every route takes its id or its name. */
export class Volume {
  readonly id: string;
  info: VolumeInfo;
  readonly files: Files;
  private readonly base: string;

  /** @internal */
  constructor(
    private readonly t: Transport,
    info: VolumeInfo,
  ) {
    this.info = info;
    this.id = info.id;
    this.base = `/v1/volumes/${seg(info.id)}`;
    this.files = new Files(t, this.base);
  }

  get name(): string {
    return this.info.name;
  }

  async refresh(): Promise<VolumeInfo> {
    this.info = camel<VolumeInfo>(await this.t.json("GET", this.base));
    return this.info;
  }

  /** Deletes it with its files and snapshots (409 while a running sandbox mounts it). */
  async delete(): Promise<void> {
    await this.t.json("DELETE", this.base);
  }

  /**
   * Runs `cmd` in a fresh machine with the volume mounted; the result's `changes` lists what
   * it added, modified and deleted, and whether that was committed.
   */
  async run(cmd: Command, opts: RunOptions = {}): Promise<ExecResult> {
    return execResult(await this.t.json("POST", `${this.base}/run`, { body: runBody(cmd, opts), signal: opts.signal }));
  }

  /** A run whose output arrives as it comes; the last event is its result. Closing the stream kills the command and commits nothing. */
  runStream(cmd: Command, opts: RunOptions = {}): AsyncGenerator<StreamEvent, void, undefined> {
    return streamCommand(this.t, "POST", `${this.base}/run`, runBody(cmd, opts), opts.signal);
  }

  async snapshot(): Promise<VolumeSnapshot> {
    return camel<VolumeSnapshot>(await this.t.json("POST", `${this.base}/snapshots`));
  }

  /** Its snapshots, newest first. */
  async snapshots(): Promise<VolumeSnapshot[]> {
    const d = await this.t.json<{ snapshots: unknown[] }>("GET", `${this.base}/snapshots`);
    return camel<VolumeSnapshot[]>(d.snapshots);
  }

  async deleteSnapshot(snapshot: string | VolumeSnapshot): Promise<void> {
    const id = typeof snapshot === "string" ? snapshot : snapshot.id;
    await this.t.json("DELETE", `${this.base}/snapshots/${seg(id)}`);
  }

  /** Its tree becomes the snapshot's (409 while a running sandbox mounts it). */
  async restore(snapshot: string | VolumeSnapshot): Promise<VolumeInfo> {
    const id = typeof snapshot === "string" ? snapshot : snapshot.id;
    this.info = camel<VolumeInfo>(await this.t.json("POST", `${this.base}/restore`, { body: { snapshot: id } }));
    return this.info;
  }

  /**
   * Fleet mode: moves the volume, with its snapshots, to another server of the fleet (a
   * node's name or id; one that runs `--node local`). 409 while a running sandbox mounts it.
   */
  async move(node: string): Promise<VolumeInfo> {
    this.info = camel<VolumeInfo>(await this.t.json("POST", `${this.base}/move`, { body: { node } }));
    return this.info;
  }

  /** A new volume `name`: a copy of this one now, or of one of its snapshots. */
  async fork(name: string, opts: { snapshot?: string | VolumeSnapshot } = {}): Promise<Volume> {
    const body: Record<string, unknown> = { name };
    if (opts.snapshot !== undefined) body["snapshot"] = typeof opts.snapshot === "string" ? opts.snapshot : opts.snapshot.id;
    return new Volume(this.t, camel<VolumeInfo>(await this.t.json("POST", `${this.base}/fork`, { body })));
  }
}

/** The tenant's volumes. */
export class Volumes {
  /** @internal */
  constructor(private readonly t: Transport) {}

  /** A new volume (`sizeMb` default 10240); 409 if the name is taken. */
  async create(name: string, opts: { sizeMb?: number } = {}): Promise<Volume> {
    const body: Record<string, unknown> = { name };
    if (opts.sizeMb !== undefined) body["size_mb"] = opts.sizeMb;
    return new Volume(this.t, camel<VolumeInfo>(await this.t.json("POST", "/v1/volumes", { body })));
  }

  /** The volume with this id or name. */
  async get(volume: string): Promise<Volume> {
    return new Volume(this.t, camel<VolumeInfo>(await this.t.json("GET", `/v1/volumes/${seg(volume)}`)));
  }

  /** The volume `name`, created if missing (safe against a concurrent create). */
  async getOrCreate(name: string, opts: { sizeMb?: number } = {}): Promise<Volume> {
    try {
      return await this.get(name);
    } catch (e) {
      if (!(e instanceof NotFound)) throw e;
    }
    try {
      return await this.create(name, opts);
    } catch (e) {
      if (e instanceof Conflict) return this.get(name);
      throw e;
    }
  }

  async list(): Promise<Volume[]> {
    const d = await this.t.json<{ volumes: unknown[] }>("GET", "/v1/volumes");
    return (d.volumes ?? []).map((v) => new Volume(this.t, camel<VolumeInfo>(v)));
  }

  async delete(volume: string): Promise<void> {
    await this.t.json("DELETE", `/v1/volumes/${seg(volume)}`);
  }
}
