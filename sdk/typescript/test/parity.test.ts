// Every operation the running server lists in /openapi.json is reached by a method of this
// package, or listed here with the reason it is not: a route added to the server without
// either fails this test.
import { test } from "node:test";
import assert from "node:assert/strict";
import { OPERATIONS, exists } from "./operations.js";
import { client } from "./helpers.js";

test("every operation of /openapi.json is a method of the package or has a reason", async () => {
  const doc = (await (await fetch(`${client().url}/openapi.json`)).json()) as { paths: Record<string, Record<string, unknown>> };
  const served: string[] = [];
  for (const [path, ops] of Object.entries(doc.paths)) {
    for (const m of Object.keys(ops)) {
      if (["get", "post", "put", "patch", "delete"].includes(m)) served.push(`${m.toUpperCase()} ${path}`);
    }
  }
  assert.ok(served.length > 40, `the server lists its operations: ${served.length}`);
  const missing = served.filter((op) => !(op in OPERATIONS));
  assert.deepEqual(missing, [], "operations the server serves that the TypeScript SDK neither calls nor explains: add a method, or a reason in OPERATIONS");
  for (const [op, c] of Object.entries(OPERATIONS)) {
    if ("by" in c) assert.ok(exists(c.by), `${op} is listed as covered by ${c.by}, which the package does not have`);
  }
  const notYet = Object.entries(OPERATIONS).filter(([, c]) => "not" in c && /not yet/i.test(c.not));
  assert.deepEqual(notYet, [], "every operation a client can use has a method: none is \"not yet\"");
  const stale = Object.keys(OPERATIONS).filter((op) => !served.includes(op));
  assert.deepEqual(stale, [], "operations listed here that the server no longer serves");
});
