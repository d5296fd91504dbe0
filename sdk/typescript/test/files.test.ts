// Files in a sandbox: text, bytes and streams both ways; list, stat, mkdir, move, remove.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { NotFound, BadRequest, type Sandbox } from "locker-sandbox";
import { client, unique } from "./helpers.js";

const c = client();
let sbx: Sandbox;

before(async () => {
  sbx = await c.sandboxes.create({ metadata: { suite: unique("files") } });
});
after(async () => {
  await sbx?.delete().catch(() => undefined);
});

test("text and bytes round-trip, and the machine sees what was written", async () => {
  const e = await sbx.files.write("/workspace/a/b/hello.txt", "héllo\n");
  assert.equal(e.type, "file");
  assert.equal(e.size, 7);
  assert.equal(await sbx.files.readText("/workspace/a/b/hello.txt"), "héllo\n");
  assert.equal((await sbx.exec(["cat", "a/b/hello.txt"])).stdout, "héllo\n");
  const all = new Uint8Array(256).map((_, i) => i);
  await sbx.files.write("/workspace/all.bin", all);
  assert.deepEqual(await sbx.files.read("/workspace/all.bin"), all);
  assert.equal((await sbx.exec(["sh", "-c", "od -An -tu1 all.bin | wc -w"])).stdout.trim(), "256");
});

test("streams: a ReadableStream or an async iterable up, a ReadableStream down", async () => {
  const piece = new Uint8Array(64 * 1024).fill(120);
  async function* pieces() {
    for (let i = 0; i < 32; i++) yield piece;
  }
  await sbx.files.write("/workspace/big.bin", pieces());
  assert.equal((await sbx.files.stat("/workspace/big.bin")).size, 32 * 64 * 1024);
  const rs = new ReadableStream<Uint8Array>({
    start(ctl) {
      ctl.enqueue(new TextEncoder().encode("from a "));
      ctl.enqueue(new TextEncoder().encode("stream"));
      ctl.close();
    },
  });
  await sbx.files.write("/workspace/rs.txt", rs);
  assert.equal(await sbx.files.readText("/workspace/rs.txt"), "from a stream");
  let total = 0;
  for await (const chunk of await sbx.files.readStream("/workspace/big.bin")) total += chunk.length;
  assert.equal(total, 32 * 64 * 1024);
});

test("list, stat, mkdir, move, remove, mode", async () => {
  await sbx.files.mkdir("/workspace/d/e");
  assert.equal((await sbx.files.stat("/workspace/d/e")).type, "dir");
  await sbx.files.write("/workspace/d/run.sh", "#!/bin/sh\necho ran\n", { mode: 0o755 });
  assert.equal((await sbx.files.stat("/workspace/d/run.sh")).mode & 0o777, 0o755);
  assert.equal((await sbx.exec(["./d/run.sh"])).stdout, "ran\n");
  const names = (await sbx.files.list("/workspace/d")).map((x) => x.name).sort();
  assert.deepEqual(names, ["e", "run.sh"]);
  const deep = (await sbx.files.list("/workspace", { depth: 3 })).map((x) => x.path);
  assert.ok(deep.includes("/workspace/d/e"), JSON.stringify(deep));
  const moved = await sbx.files.move("/workspace/d/run.sh", "/workspace/d/e/moved.sh");
  assert.equal(moved.path, "/workspace/d/e/moved.sh");
  assert.equal(await sbx.files.exists("/workspace/d/run.sh"), false);
  await assert.rejects(sbx.files.remove("/workspace/d"), (e: unknown) => e instanceof BadRequest || (e as { status?: number }).status === 409);
  await sbx.files.remove("/workspace/d", { recursive: true });
  assert.equal(await sbx.files.exists("/workspace/d"), false);
  await assert.rejects(sbx.files.readText("/workspace/d/e/moved.sh"), NotFound);
});

test("a directory goes down as a tar and comes back up into another", async () => {
  await sbx.files.write("/workspace/tree/a.txt", "A");
  await sbx.files.write("/workspace/tree/sub/b.sh", "#!/bin/sh\n", { mode: 0o755 });
  await sbx.exec(["ln", "-s", "a.txt", "tree/link"]);
  const tar = new Uint8Array(await new Response(await sbx.files.readTar("/workspace/tree")).arrayBuffer());
  assert.ok(tar.length >= 512 * 4, `a tar archive: ${tar.length} bytes`);
  const up = await sbx.files.writeTar("/workspace/copy", tar);
  assert.equal(up.type, "dir");
  assert.ok(up.entries >= 4, JSON.stringify(up));
  assert.equal(up.bytes, 1 + "#!/bin/sh\n".length);
  assert.equal(await sbx.files.readText("/workspace/copy/a.txt"), "A");
  assert.equal((await sbx.files.stat("/workspace/copy/sub/b.sh")).mode & 0o777, 0o755);
  assert.equal((await sbx.exec(["readlink", "copy/link"])).stdout, "a.txt\n");
  await assert.rejects(sbx.files.writeTar("/workspace/bad", "not a tar archive at all".repeat(40)), BadRequest);
});
