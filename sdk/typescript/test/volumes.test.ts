// Volumes and serverless runs: files without a machine, runs with each commit mode and the
// change list, snapshots, restore, forks, records by volume name.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { Conflict, NotFound, type Volume } from "locker-sandbox";
import { client, unique } from "./helpers.js";

const c = client();
const name = unique("vol");
let vol: Volume;
const extra: string[] = [];

before(async () => {
  vol = await c.volumes.create(name, { sizeMb: 64 });
});
after(async () => {
  for (const v of [...extra, name]) await c.volumes.delete(v).catch(() => undefined);
});

test("a volume is found by id and by name, listed, and its name is unique", async () => {
  assert.match(vol.id, /^vol_/);
  assert.equal(vol.name, name);
  assert.equal(vol.info.sizeMb, 64);
  assert.equal((await c.volumes.get(name)).id, vol.id);
  assert.ok((await c.volumes.list()).some((v) => v.id === vol.id));
  assert.equal((await c.volumes.getOrCreate(name)).id, vol.id);
  await assert.rejects(c.volumes.create(name), (e: unknown) => e instanceof Conflict && e.code === "conflict" && e.status === 409);
});

test("run commits by default and lists its changes", async () => {
  await vol.files.write("/keep.txt", "v1");
  await vol.files.write("/gone.txt", "bye");
  const r = await vol.run("echo v2 > keep.txt; rm gone.txt; echo new > new.txt; pwd");
  assert.equal(r.exitCode, 0);
  assert.equal(r.stdout, "/workspace\n");
  assert.ok(r.changes);
  assert.ok(r.changes.added.some((p) => p.endsWith("new.txt")), JSON.stringify(r.changes));
  assert.ok(r.changes.modified.some((p) => p.endsWith("keep.txt")), JSON.stringify(r.changes));
  assert.ok(r.changes.deleted.some((p) => p.endsWith("gone.txt")), JSON.stringify(r.changes));
  assert.equal(r.changes.committed, true);
  assert.equal(await vol.files.readText("/keep.txt"), "v2\n");
  assert.equal(await vol.files.exists("/gone.txt"), false);
});

test("on_success commits nothing after a failure; never commits nothing at all", async () => {
  const failed = await vol.run(["sh", "-c", "echo x > failed.txt; exit 1"], { commit: "on_success" });
  assert.equal(failed.exitCode, 1);
  assert.equal(failed.changes?.committed, false);
  assert.equal(await vol.files.exists("/failed.txt"), false);
  const ok = await vol.run(["sh", "-c", "echo x > ok.txt"], { commit: "on_success", mountPath: "/data", cwd: "/data" });
  assert.equal(ok.changes?.committed, true);
  assert.equal(await vol.files.readText("/ok.txt"), "x\n");
  const never = await vol.run("echo y > never.txt", { commit: "never" });
  assert.equal(never.changes?.committed, false);
  assert.ok(never.changes?.added.some((p) => p.endsWith("never.txt")));
  assert.equal(await vol.files.exists("/never.txt"), false);
  const viaClient = await c.run(name, ["cat", "ok.txt"]);
  assert.equal(viaClient.stdout, "x\n");
});

test("a run's timeout is a result too", async () => {
  const r = await vol.run(["sleep", "30"], { timeoutMs: 500 });
  assert.equal(r.timedOut, true);
});

test("runStream yields output, then the result with the changes", async () => {
  const types: string[] = [];
  let committed: boolean | undefined;
  for await (const ev of vol.runStream("echo streamed; echo s > streamed.txt")) {
    types.push(ev.type);
    if (ev.type === "result") committed = ev.result.changes?.committed;
  }
  assert.deepEqual(types, ["stdout", "result"]);
  assert.equal(committed, true);
});

test("snapshots, restore and forks", async () => {
  await vol.files.write("/snap.txt", "before");
  const snap = await vol.snapshot();
  assert.equal(snap.volumeId, vol.id);
  assert.ok((await vol.snapshots()).some((s) => s.id === snap.id));
  await vol.files.write("/snap.txt", "after");
  const forkName = unique("fork");
  extra.push(forkName);
  const fork = await vol.fork(forkName, { snapshot: snap });
  assert.equal(await fork.files.readText("/snap.txt"), "before");
  const now = unique("now");
  extra.push(now);
  assert.equal(await (await vol.fork(now)).files.readText("/snap.txt"), "after");
  await vol.restore(snap);
  assert.equal(await vol.files.readText("/snap.txt"), "before");
  await vol.deleteSnapshot(snap.id);
  assert.ok(!(await vol.snapshots()).some((s) => s.id === snap.id));
  await fork.delete();
  await assert.rejects(c.volumes.get(forkName), NotFound);
});

test("a sandbox mounts the volume; deleting a mounted volume is a conflict", async () => {
  await using sbx = await c.sandboxes.create({ volumes: [{ volume: name, path: "/workspace" }] });
  assert.equal((await sbx.exec(["cat", "keep.txt"])).stdout, "v2\n");
  await assert.rejects(vol.delete(), Conflict);
});

test("call records are found by the volume's name", async () => {
  const r = await vol.run(["true"]);
  const calls = await c.calls({ volumeId: name, limit: 100 });
  assert.ok(calls.some((x) => x.id === r.callId && x.kind === "run"), JSON.stringify(calls.slice(0, 1)));
});
