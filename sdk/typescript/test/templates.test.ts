// Templates as served: the list, and removal's refusals (no test removes a real template:
// they are shared by every server of the host).
import { test } from "node:test";
import assert from "node:assert/strict";
import { Conflict, NotFound } from "locker-sandbox";
import { client, unique } from "./helpers.js";

const c = client();

test("the host's templates are listed with their digest and packages", async () => {
  const all = await c.templates.list();
  const def = all.find((t) => t.name === "default");
  assert.ok(def, JSON.stringify(all.map((t) => t.name)));
  assert.match(def.digest, /^[0-9a-f]{64}$/);
  assert.ok(def.packages.includes("python3"));
  assert.ok(def.sizeBytes > 0);
});

test("removing `default` is a conflict and an unknown name is not found", async () => {
  await assert.rejects(c.templates.delete("default"), Conflict);
  await assert.rejects(c.templates.delete(unique("no-such-template")), NotFound);
});
