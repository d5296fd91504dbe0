// The frameworks' examples (examples/*.ts) run as programs with `--offline`: each framework's
// real package with a scripted stand-in for the model, every tool call in a real sandbox
// (what the tools answered is printed and checked here), and the sandbox gone afterwards.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { client } from "./helpers.js";

const c = client();

async function runExample(name: string): Promise<string> {
  const script = fileURLToPath(new URL(`../examples/${name}.js`, import.meta.url));
  const { stdout } = await promisify(execFile)(process.execPath, [script, "--offline"], {
    env: { ...process.env, OPENAI_AGENTS_DISABLE_TRACING: "1" },
    timeout: 120_000,
  });
  const left = await c.sandboxes.list({ metadata: { example: name } });
  assert.deepEqual(left.map((s) => s.id), [], `${name} deleted its sandbox`);
  return stdout;
}

test("the Anthropic example's tool loop writes and runs fib.py in a sandbox", async () => {
  const out = await runExample("anthropic-agent");
  assert.match(out, /\[tool\] File created successfully at: \/workspace\/fib\.py\n\[tool\] 832040\n/);
  assert.match(out, /\[done after 3 model calls, 2 tool calls, 0 errors\]/);
});

test("the AI SDK example's generateText writes and runs hello.py in a sandbox", async () => {
  const out = await runExample("ai-sdk-agent");
  assert.match(out, /\[writeFile\] File created successfully at: \/workspace\/hello\.py\n\[bash\] 5050\n/);
  assert.match(out, /\[3 steps; tools: writeFile, bash\]/);
});

test("the OpenAI Agents example's SandboxAgent patches and runs greet.py in a Locker sandbox", async () => {
  const out = await runExample("openai-agents-sandbox");
  const outputs = out.split("[tool] ").slice(1);
  assert.equal(outputs.length, 3, out);
  assert.match(outputs[0]!, /Process exited with code 0\nOutput:\nhello, nobody\n/);
  assert.match(outputs[1]!, /^Updated greet\.py/);
  assert.match(outputs[2]!, /Process exited with code 0\nOutput:\nhello, world\n/);
});
