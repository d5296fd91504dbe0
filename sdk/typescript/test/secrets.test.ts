// Secrets by name through the SDK: create, get, list and rotate never show a value; a
// sandbox and a serverless run that name a secret hold a placeholder in its env variable,
// never the value, and the secret's host joins the sandbox's allowlist; unknown secrets
// and secrets under `none` are typed errors; delete. (The egress proxy putting the value
// into requests is tests/secrets.rs's, with its own test hosts.)
import { test, after } from "node:test";
import assert from "node:assert/strict";
import { BadRequest, Conflict, NotFound } from "locker-sandbox";
import { client, unique } from "./helpers.js";

const c = client();
const name = unique("ts_secret").replace(/-/g, "_");
const value = `sk-${unique("value")}`;
const volume = unique("ts-secret-vol");

after(async () => {
  await c.secrets.delete(name).catch(() => undefined);
  await c.volumes.delete(volume).catch(() => undefined);
});

test("a secret is created, read, listed and rotated without its value ever coming back", async () => {
  const made = await c.secrets.create(name, value, { hosts: ["api.example.com"], env: "EXAMPLE_API_KEY" });
  assert.deepEqual([made.name, made.hosts, made.env], [name, ["api.example.com"], "EXAMPLE_API_KEY"]);
  assert.equal(typeof made.createdAt, "string");
  await assert.rejects(c.secrets.create(name, value, { hosts: ["api.example.com"], env: "X" }), Conflict);
  const got = await c.secrets.get(name);
  const listed = (await c.secrets.list()).find((s) => s.name === name);
  assert.ok(listed, "the new secret is listed");
  for (const s of [made, got, listed]) assert.ok(!JSON.stringify(s).includes(value), "no value in an answer");
  const rotated = await c.secrets.rotate(name, { value: `${value}-2`, hosts: ["api.example.com", "api2.example.com"] });
  assert.deepEqual(rotated.hosts, ["api.example.com", "api2.example.com"]);
  assert.ok(!JSON.stringify(rotated).includes(value));
  await assert.rejects(c.secrets.get(unique("nope").replace(/-/g, "_")), NotFound);
});

test("a sandbox and a run that name the secret hold its placeholder, not its value", async () => {
  await using sbx = await c.sandboxes.create({ secrets: [name] });
  assert.equal(sbx.info.network.egress, "allow");
  assert.ok(sbx.info.network.allow?.includes("api.example.com"), JSON.stringify(sbx.info.network));
  const env = (await sbx.exec(["sh", "-c", "printf %s \"$EXAMPLE_API_KEY\""])).stdout;
  assert.match(env, new RegExp(`^locker-secret-${name}-[0-9a-f]{32}$`));
  assert.ok(!env.includes(value));
  const all = (await sbx.exec(["sh", "-c", "env; cat /proc/1/environ 2>/dev/null"])).stdout;
  assert.ok(!all.includes(value), "the value is nowhere in the machine's env");

  const vol = await c.volumes.create(volume);
  const run = await vol.run(["sh", "-c", "printf %s \"$EXAMPLE_API_KEY\""], { secrets: [name] });
  assert.match(run.stdout, new RegExp(`^locker-secret-${name}-[0-9a-f]{32}$`));
  assert.notEqual(run.stdout, env, "placeholders are per machine");

  await assert.rejects(c.sandboxes.create({ secrets: [name], network: { internet: false } }), BadRequest);
  await assert.rejects(c.sandboxes.create({ secrets: [unique("unknown").replace(/-/g, "_")] }), NotFound);
});

test("a deleted secret is gone", async () => {
  await c.secrets.delete(name);
  await assert.rejects(c.secrets.get(name), NotFound);
  await assert.rejects(c.secrets.delete(name), NotFound);
});
