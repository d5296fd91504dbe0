/**
 * Secrets: values (API keys, tokens) a machine's code uses but never sees. A machine that
 * names a secret holds a placeholder in its env variable; Locker's egress proxy puts the
 * value into requests to the secret's hosts only. No call here ever returns a value.
 *
 * Paths and bodies of `/v1/secrets…` live here.
 */

import { seg, type Transport } from "./transport.js";
import { camel } from "./types.js";

/** A secret as the API shows it (never its value). */
export interface SecretInfo {
  name: string;
  hosts: string[];
  env: string;
  createdAt: string;
  updatedAt: string;
}

export class Secrets {
  /** @internal */
  constructor(private readonly t: Transport) {}

  /** A new secret; 409 if the name is taken. */
  async create(name: string, value: string, opts: { hosts: string[]; env: string }): Promise<SecretInfo> {
    const body = { name, value, hosts: opts.hosts, env: opts.env };
    return camel<SecretInfo>(await this.t.json("POST", "/v1/secrets", { body }));
  }

  async list(): Promise<SecretInfo[]> {
    return camel<SecretInfo[]>((await this.t.json<{ secrets: unknown[] }>("GET", "/v1/secrets")).secrets);
  }

  async get(name: string): Promise<SecretInfo> {
    return camel<SecretInfo>(await this.t.json("GET", `/v1/secrets/${seg(name)}`));
  }

  /** A new value (used from the next request on), new hosts and/or a new env variable. */
  async rotate(name: string, change: { value?: string; hosts?: string[]; env?: string }): Promise<SecretInfo> {
    const body: Record<string, unknown> = {};
    if (change.value !== undefined) body["value"] = change.value;
    if (change.hosts !== undefined) body["hosts"] = change.hosts;
    if (change.env !== undefined) body["env"] = change.env;
    return camel<SecretInfo>(await this.t.json("PUT", `/v1/secrets/${seg(name)}`, { body }));
  }

  async delete(name: string): Promise<void> {
    await this.t.json("DELETE", `/v1/secrets/${seg(name)}`);
  }
}
