// What `npm pack` would publish: the built ESM with its declarations (and the sources its
// maps point at), the README, no tests, no build output of the tests, no runtime dependency.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { readFile } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

const root = fileURLToPath(new URL("../../", import.meta.url));

test("the package ships dist with types and no runtime dependencies", async () => {
  const pkg = JSON.parse(await readFile(`${root}package.json`, "utf8")) as Record<string, unknown>;
  assert.equal(pkg["type"], "module");
  assert.equal(pkg["dependencies"], undefined, "no runtime dependencies");
  assert.deepEqual(pkg["exports"], { ".": { types: "./dist/index.d.ts", import: "./dist/index.js" } });
  const { stdout } = await promisify(execFile)("npm", ["pack", "--dry-run", "--json", "--ignore-scripts"], { cwd: root });
  const files = (JSON.parse(stdout) as { files: { path: string }[] }[])[0]!.files.map((f) => f.path);
  for (const f of ["package.json", "README.md", "dist/index.js", "dist/index.d.ts", "dist/sandbox.d.ts", "src/index.ts"]) {
    assert.ok(files.includes(f), `${f} is in the package: ${files.join(", ")}`);
  }
  assert.deepEqual(files.filter((f) => /^(test|build|bench|examples|node_modules)\//.test(f)), []);
});

test("the built package imports and exposes its API", async () => {
  const m = await import("locker-sandbox");
  for (const name of ["Client", "Sandbox", "Volume", "Files", "Process", "Pty", "LockerError", "NotFound", "Conflict", "QuotaExceeded", "BadRequest", "Unauthorized"]) {
    assert.equal(typeof (m as Record<string, unknown>)[name], "function", name);
  }
});
