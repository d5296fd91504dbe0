// Templates of your own through the SDK, against a server on a private template cache
// (tests/typescript_sdk.rs starts it; builds leave step templates behind, so never on the
// host's): a Dockerfile build FROM default with COPY from a context (a directory on disk,
// and a map of files), RUN, ENV and WORKDIR, followed as an async iterator of log lines,
// progress and the result; a sandbox from the template sees what the Dockerfile made; a
// failing RUN is `BuildFailed` with its log; a bad Dockerfile is a 400 before any build;
// an image archive (`docker save`'s layout, made here with tar around a busybox root) is
// imported from bytes and from a stream and becomes a sandbox with the image's config.
import { test, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { createReadStream } from "node:fs";
import { copyFile, mkdir, mkdtemp, readFile, rm, symlink, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { Readable } from "node:stream";
import { BadRequest, BuildFailed, Conflict, NotFound, type BuildEvent, type TemplateInfo } from "locker-sandbox";
import { client, unique } from "../helpers.js";

const c = client();
const made: string[] = [];
const dirs: string[] = [];

after(async () => {
  for (const n of made) await c.templates.delete(n).catch(() => undefined);
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

async function tempdir(tag: string): Promise<string> {
  const d = await mkdtemp(`${tmpdir()}/locker-ts-${tag}-`);
  dirs.push(d);
  return d;
}

test("a Dockerfile build is followed as events and its template makes sandboxes", async () => {
  const ctx = await tempdir("ctx");
  await mkdir(`${ctx}/conf`);
  await writeFile(`${ctx}/conf/app.txt`, "from the context\n");
  await writeFile(`${ctx}/run.sh`, "#!/bin/sh\necho ran\n", { mode: 0o755 });
  const name = unique("ts-build").slice(0, 40);
  made.push(name);
  const dockerfile = [
    "FROM default",
    "ARG WHO=nobody",
    "ENV GREETING=hello-$WHO",
    "WORKDIR /srv/app",
    "COPY conf/app.txt run.sh /srv/app/",
    "RUN /srv/app/run.sh > /srv/app/built.txt && echo \"$GREETING\" >> /srv/app/built.txt",
  ].join("\n");
  const build = await c.templates.build(name, { dockerfile, context: ctx, buildArgs: { WHO: "ts" } });
  assert.match(build.id, /^tpl_/);
  const events: BuildEvent[] = [];
  for await (const ev of build) events.push(ev);
  const logs = events.flatMap((e) => (e.type === "log" ? [e.line] : []));
  assert.ok(logs.some((l) => /step 6\/6/.test(l)), `the log names the steps: ${logs.join("\n")}`);
  assert.ok(events.some((e) => e.type === "progress" && e.steps === 6), "progress events count the steps");
  const last = events.at(-1)!;
  assert.equal(last.type, "result");
  assert.equal(last.type === "result" && last.state, "succeeded");
  const tpl = await build.wait();
  assert.equal(tpl.name, name);
  assert.match(tpl.digest, /^[0-9a-f]{64}$/);
  assert.equal(tpl.workdir, "/srv/app");
  assert.equal(tpl.env?.["GREETING"], "hello-ts", "env keys are kept as written");
  const status = await build.status();
  assert.equal(status.state, "succeeded");
  assert.equal(status.buildId, build.id);
  assert.ok(status.log.length > 0);
  assert.equal((await c.templates.get(name)).digest, tpl.digest);
  assert.ok((await c.templates.list()).some((t) => t.name === name));

  await using sbx = await c.sandboxes.create({ template: name, workdir: null });
  const r = await sbx.exec("pwd; cat app.txt built.txt; echo $GREETING");
  assert.equal(r.stdout, "/srv/app\nfrom the context\nran\nhello-ts\nhello-ts\n", r.stderr);
});

test("a context as a map of files, wait() with onEvent, and a template in use is not removed", async () => {
  const name = unique("ts-map").slice(0, 40);
  made.push(name);
  const build = await c.templates.build(name, {
    dockerfile: "FROM default\nCOPY deep/ /opt/ctx/deep/\nCOPY tool.sh /opt/ctx/\nRUN cat /opt/ctx/deep/er/file.txt > /opt/copy.txt",
    context: { "deep/er/file.txt": "nested\n", "tool.sh": { data: "#!/bin/sh\necho tool\n", mode: 0o755 } },
  });
  const seen: BuildEvent[] = [];
  const tpl = await build.wait({ onEvent: (e) => seen.push(e) });
  assert.ok(seen.some((e) => e.type === "log"));
  assert.ok(!seen.some((e) => e.type === "result"), "onEvent gets everything but the result");
  const sbx = await c.sandboxes.create({ template: tpl.name });
  try {
    assert.equal((await sbx.exec("cat /opt/copy.txt; /opt/ctx/tool.sh")).stdout, "nested\ntool\n");
    await assert.rejects(c.templates.delete(name), Conflict);
  } finally {
    await sbx.delete();
  }
  await c.templates.delete(name);
  await assert.rejects(c.templates.get(name), NotFound);
});

test("a failing RUN is BuildFailed with its log; a bad Dockerfile is refused before a build", async () => {
  const name = unique("ts-fail").slice(0, 40);
  made.push(name);
  const build = await c.templates.build(name, { dockerfile: "FROM default\nRUN echo about to fail; exit 7" });
  await assert.rejects(build.wait(), (e: unknown) => {
    assert.ok(e instanceof BuildFailed, String(e));
    assert.equal(e.buildId, build.id);
    assert.ok(e.log.some((l) => l.includes("about to fail")), e.log.join("\n"));
    return true;
  });
  assert.equal((await build.status()).state, "failed");
  await assert.rejects(c.templates.get(name), NotFound, "a failed build leaves no template");
  await assert.rejects(
    c.templates.build(unique("ts-bad").slice(0, 40), { dockerfile: "FROM default\nHEALTHCHECK CMD true" }),
    (e: unknown) => e instanceof BadRequest && /line 2/.test(e.message),
  );
  await assert.rejects(c.templates.build("x", { dockerfile: "FROM default", template: "default" }), TypeError);
});

/** A `docker save` archive of one layer: busybox as /bin/sh, a file, with env, workdir and a label. */
async function dockerArchive(): Promise<string> {
  const d = await tempdir("image");
  const root = `${d}/root`;
  await mkdir(`${root}/bin`, { recursive: true });
  await mkdir(`${root}/etc`);
  await mkdir(`${root}/srv/app`, { recursive: true });
  await copyFile("/bin/busybox", `${root}/bin/busybox`).catch((e: unknown) => {
    throw new Error(`busybox is needed for the image (apt-get install busybox-static): ${String(e)}`);
  });
  await symlink("busybox", `${root}/bin/sh`);
  await writeFile(`${root}/etc/greeting`, "hello from the image\n");
  await mkdir(`${d}/img/layer`, { recursive: true });
  execFileSync("tar", ["-C", root, "-cf", `${d}/img/layer/layer.tar`, "."]);
  const layer = await readFile(`${d}/img/layer/layer.tar`);
  const sha = (b: Uint8Array | string) => createHash("sha256").update(b).digest("hex");
  const config = JSON.stringify({
    architecture: "amd64",
    os: "linux",
    config: { Env: ["PATH=/bin", "GREETING=from-config"], WorkingDir: "/srv/app", Labels: { "org.example.made_by": "ts-sdk" } },
    rootfs: { type: "layers", diff_ids: [`sha256:${sha(layer)}`] },
  });
  const cfg = `${sha(config)}.json`;
  await writeFile(`${d}/img/${cfg}`, config);
  await writeFile(`${d}/img/manifest.json`, JSON.stringify([{ Config: cfg, RepoTags: ["ts:latest"], Layers: ["layer/layer.tar"] }]));
  execFileSync("tar", ["-C", `${d}/img`, "-cf", `${d}/image.tar`, "manifest.json", cfg, "layer/layer.tar"]);
  return `${d}/image.tar`;
}

test("an image archive is imported from bytes and from a stream, and becomes a sandbox", async () => {
  const archive = await dockerArchive();
  const a = unique("ts-img").slice(0, 40);
  const b = unique("ts-img2").slice(0, 40);
  made.push(a, b);
  const first: TemplateInfo = await c.templates.importImage(a, await readFile(archive));
  assert.equal(first.name, a);
  assert.deepEqual(first.packages, []);
  assert.equal(first.config?.workdir, "/srv/app");
  assert.equal(first.config?.env?.["GREETING"], "from-config");
  assert.equal(first.config?.labels?.["org.example.made_by"], "ts-sdk", "label keys are kept as written");
  const stream = Readable.toWeb(createReadStream(archive)) as unknown as ReadableStream<Uint8Array>;
  const second = await c.templates.importImage(b, stream);
  assert.equal(second.digest, first.digest, "the same image under another name is one template");
  await using sbx = await c.sandboxes.create({ template: a, workdir: null });
  assert.equal((await sbx.exec("pwd; cat /etc/greeting; echo $GREETING")).stdout, "/srv/app\nhello from the image\nfrom-config\n");
  await assert.rejects(c.templates.importImage(unique("ts-junk").slice(0, 40), "not an image"), BadRequest);
});
