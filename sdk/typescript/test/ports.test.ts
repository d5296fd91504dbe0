// Ports and preview URLs: the listening port is listed, the path proxy reaches it with
// the API key, the preview host with the preview token, and `expose` opens it to anyone
// and closes it again.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import http from "node:http";
import type { Sandbox } from "locker-sandbox";
import { client, unique, waitFor } from "./helpers.js";

const c = client();
let sbx: Sandbox;
const PORT = 8000;

before(async () => {
  sbx = await c.sandboxes.create({ metadata: { suite: unique("ports") } });
  await sbx.files.write("/workspace/index.html", "served from the sandbox\n");
  await sbx.processes.start(["python3", "-m", "http.server", String(PORT), "--bind", "127.0.0.1"]);
  await waitFor("the port to listen", async () => (await sbx.ports()).some((p) => p.port === PORT));
});
after(async () => {
  await sbx?.delete().catch(() => undefined);
});

/** A GET of `url` sent to the server under test whatever its host name resolves to (as a browser would send it). */
function get(url: string, headers: Record<string, string> = {}): Promise<{ status: number; body: string }> {
  const u = new URL(url);
  const server = new URL(c.url);
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: server.hostname, port: server.port, path: u.pathname + u.search, headers: { ...headers, Host: u.host } },
      (res) => {
        let body = "";
        res.setEncoding("utf8");
        res.on("data", (d: string) => (body += d));
        res.on("end", () => resolve({ status: res.statusCode ?? 0, body }));
      },
    );
    req.on("error", reject);
    req.end();
  });
}

test("ports lists the listener with its URLs", async () => {
  const p = (await sbx.ports()).find((x) => x.port === PORT)!;
  assert.equal(p.public, false);
  assert.equal(p.process, "python3");
  assert.match(p.proxyUrl, new RegExp(`/v1/sandboxes/${sbx.id}/ports/${PORT}/$`));
  assert.equal(typeof p.url, "string");
});

test("url() reaches the port through the path proxy with the API key", async () => {
  const url = sbx.url(PORT, "/index.html");
  assert.equal(url, `${c.url}/v1/sandboxes/${sbx.id}/ports/${PORT}/index.html`);
  const res = await fetch(url, { headers: { Authorization: `Bearer ${process.env.LOCKER_API_KEY}` } });
  assert.equal(res.status, 200);
  assert.equal(await res.text(), "served from the sandbox\n");
  assert.throws(() => sbx.url(70000), RangeError);
});

test("previewUrl() carries the token; expose opens the port to anyone and closes it", async () => {
  const withToken = await sbx.previewUrl(PORT, { path: "/index.html" });
  assert.ok(withToken, "a server on loopback has the localhost preview domain");
  assert.match(withToken, new RegExp(`^http://${PORT}-${sbx.id}\\.localhost:\\d+/index\\.html\\?locker_token=lpt_`));
  const bare = (await sbx.previewUrl(PORT, { path: "/index.html", token: false }))!;
  assert.equal((await get(bare)).status, 401, "a private port needs a credential");
  assert.equal((await get(bare, { "X-Locker-Token": sbx.info.previewToken! })).body, "served from the sandbox\n");
  const opened = await sbx.expose(PORT);
  assert.match(opened, new RegExp(`^http://${PORT}-${sbx.id}\\.localhost:\\d+/$`));
  assert.equal((await get(bare)).body, "served from the sandbox\n");
  assert.equal((await sbx.ports()).find((x) => x.port === PORT)!.public, true);
  await sbx.expose(PORT, { public: false });
  assert.equal((await get(bare)).status, 401);
  const old = sbx.info.previewToken!;
  const rotated = await sbx.rotatePreviewToken();
  assert.notEqual(rotated, old);
  assert.equal((await get(bare, { "X-Locker-Token": old })).status, 401);
  assert.equal((await get(bare, { "X-Locker-Token": rotated })).status, 200);
});
