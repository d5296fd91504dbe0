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
  const exports = pkg["exports"] as Record<string, unknown>;
  assert.deepEqual(exports["."], { types: "./dist/index.d.ts", import: "./dist/index.js" });
  // The frameworks' doors are subpaths; their frameworks are optional peers, never installed with the core.
  for (const door of ["ai", "anthropic", "openai-agents"]) {
    assert.deepEqual(exports[`./${door}`], { types: `./dist/${door}.d.ts`, import: `./dist/${door}.js` });
  }
  const peers = pkg["peerDependencies"] as Record<string, string>;
  const meta = pkg["peerDependenciesMeta"] as Record<string, { optional?: boolean }>;
  for (const p of Object.keys(peers)) assert.equal(meta[p]?.optional, true, `${p} is an optional peer`);
  const { stdout } = await promisify(execFile)("npm", ["pack", "--dry-run", "--json", "--ignore-scripts"], { cwd: root });
  const files = (JSON.parse(stdout) as { files: { path: string }[] }[])[0]!.files.map((f) => f.path);
  for (const f of ["package.json", "README.md", "dist/index.js", "dist/index.d.ts", "dist/sandbox.d.ts", "src/index.ts", "dist/ai.js", "dist/anthropic.js", "dist/openai-agents.d.ts"]) {
    assert.ok(files.includes(f), `${f} is in the package: ${files.join(", ")}`);
  }
  assert.deepEqual(files.filter((f) => /^(test|build|bench|examples|node_modules)\//.test(f)), []);
});

test("the built package imports and exposes its API", async () => {
  const m = await import("locker-sandbox");
  for (const name of ["Client", "Sandbox", "Volume", "Files", "Process", "Pty", "CodeContext", "McpServer", "BashSession", "TextEditor", "LockerError", "NotFound", "Conflict", "QuotaExceeded", "BadRequest", "Unauthorized"]) {
    assert.equal(typeof (m as Record<string, unknown>)[name], "function", name);
  }
});

test("the core imports no framework: it loads where none is installed", async () => {
  const { readdir } = await import("node:fs/promises");
  const doors = new Set(["ai.js", "anthropic.js", "openai-agents.js"]);
  for (const f of (await readdir(`${root}dist`)).filter((f) => f.endsWith(".js") && !doors.has(f))) {
    const src = await readFile(`${root}dist/${f}`, "utf8");
    const bare = [...src.matchAll(/^(?:import|export)\b[^;]*?\bfrom\s+"([^".][^"]*)"/gm)].map((m) => m[1]);
    assert.deepEqual(bare, [], `dist/${f} imports only relative modules`);
  }
});
