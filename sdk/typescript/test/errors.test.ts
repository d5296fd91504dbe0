// Typed errors carry the server's status, code and message; retries happen only for GETs
// whose connection failed, never for a call that could change something.
import { test } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import {
  BadRequest,
  Client,
  ConnectionError,
  LockerError,
  NotFound,
  QuotaExceeded,
  Sandbox,
  Unauthorized,
  Unprocessable,
} from "locker-sandbox";
import { client, unique } from "./helpers.js";

const c = client();

test("a missing sandbox is NotFound with the server's code and message", async () => {
  const e = await c.sandboxes.get("sb_doesnotexist").catch((x: unknown) => x);
  assert.ok(e instanceof NotFound && e instanceof LockerError);
  assert.equal(e.status, 404);
  assert.equal(e.code, "not_found");
  assert.match(e.message, /sb_doesnotexist/);
  assert.equal(e.name, "NotFound");
});

test("a wrong key is Unauthorized", async () => {
  const bad = new Client({ url: c.url, apiKey: "lk_wrong" });
  await assert.rejects(bad.sandboxes.list(), (e: unknown) => e instanceof Unauthorized && e.code === "unauthorized");
});

test("bad input is BadRequest naming what to fix; a quota or host limit is its own class", async () => {
  await using sbx = await c.sandboxes.create({ metadata: { suite: unique("errors") } });
  await assert.rejects(sbx.exec(["true"], { cwd: "/nonexistent" }), (e: unknown) => e instanceof BadRequest && /cwd/.test(e.message));
  await assert.rejects(c.volumes.create("Not A Name"), BadRequest);
  await assert.rejects(c.sandboxes.create({ memoryMb: 1 << 30 }), (e: unknown) => e instanceof BadRequest && /memory_mb/.test(e.message));
  await assert.rejects(
    c.sandboxes.create({ diskMb: 1048576 }),
    (e: unknown) => e instanceof Unprocessable && e.code === "unprocessable" && e.status === 422,
  );
  await assert.rejects(sbx.exec([] as string[]), TypeError);
});

test("a quota past its limit is QuotaExceeded", async () => {
  // tests/typescript_sdk.rs starts the server with --quota-memory-mb 16384.
  const e = await c.sandboxes.create({ memoryMb: 32768, diskMb: 64 }).catch((x: unknown) => x);
  if (e instanceof Sandbox) await e.delete();
  assert.ok(e instanceof QuotaExceeded, String(e));
  assert.equal(e.status, 429);
  assert.match(e.message, /memory/i);
});

/** A port where nothing listens. */
async function deadPort(): Promise<number> {
  const srv = net.createServer();
  await new Promise<void>((r) => srv.listen(0, "127.0.0.1", r));
  const port = (srv.address() as net.AddressInfo).port;
  await new Promise((r) => srv.close(r));
  return port;
}

test("a GET is retried on a connection error, a POST never is", async () => {
  const url = `http://127.0.0.1:${await deadPort()}`;
  const sent: string[] = [];
  const counting: typeof fetch = (input, init) => {
    sent.push(init?.method ?? "GET");
    return fetch(input, init);
  };
  const dead = new Client({ url, apiKey: "k", fetch: counting });
  await assert.rejects(dead.sandboxes.list(), (e: unknown) => e instanceof ConnectionError && e.status === 0 && e.code === "unreachable");
  assert.deepEqual(sent, ["GET", "GET", "GET"]);
  sent.length = 0;
  await assert.rejects(dead.sandboxes.create(), ConnectionError);
  assert.deepEqual(sent, ["POST"]);
});

test("a GET that failed once succeeds on its retry", async () => {
  let failures = 1;
  const flaky: typeof fetch = (input, init) => {
    if (failures-- > 0) return Promise.reject(new TypeError("fetch failed"));
    return fetch(input, init);
  };
  const cl = new Client({ url: c.url, apiKey: process.env.LOCKER_API_KEY, fetch: flaky });
  assert.ok(Array.isArray(await cl.sandboxes.list()));
});
