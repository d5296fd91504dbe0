// The Vercel AI SDK's door: `generateText` of the real `ai` package, with a scripted stand-in
// model (`MockLanguageModelV3` from `ai/test`), calls lockerTools in a real sandbox: calls of
// one step run together, bash keeps its cwd and exports, a failed edit goes back to the model
// as the tool's error, and `run` on a volume reports its change list.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { generateText, stepCountIs } from "ai";
import { MockLanguageModelV3 } from "ai/test";
import type { Sandbox, Volume } from "locker-sandbox";
import { lockerTools } from "locker-sandbox/ai";
import { client, unique } from "./helpers.js";

const c = client();
let sbx: Sandbox;
let vol: Volume;

before(async () => {
  sbx = await c.sandboxes.create({ metadata: { suite: unique("ai") } });
  vol = await c.volumes.create(unique("ai-vol"), { sizeMb: 64 });
});
after(async () => {
  await sbx?.delete().catch(() => undefined);
  await vol?.delete().catch(() => undefined);
});

type Prompt = Array<{ role: string; content: any }>;
type Call = { toolName: string; input: unknown };
const usage = {
  inputTokens: { total: 1, noCache: 1, cacheRead: 0, cacheWrite: 0 },
  outputTokens: { total: 1, text: 1, reasoning: 0 },
};
let ids = 0;

/** A model that answers each step from `steps`: tool calls, or a final text. */
function scripted(steps: Array<(prompt: Prompt) => Call[] | string>) {
  let i = 0;
  return new MockLanguageModelV3({
    doGenerate: async ({ prompt }) => {
      const step = steps[i++];
      if (!step) throw new Error("the script has no more steps");
      const out = step(prompt as Prompt);
      if (typeof out === "string") {
        return { content: [{ type: "text", text: out }], finishReason: { unified: "stop", raw: "stop" }, usage, warnings: [] };
      }
      return {
        content: out.map((c) => ({ type: "tool-call" as const, toolCallId: `call_${++ids}`, toolName: c.toolName, input: JSON.stringify(c.input) })),
        finishReason: { unified: "tool-calls", raw: "tool_calls" },
        usage,
        warnings: [],
      };
    },
  });
}

/** The tool results the model was sent last: [toolName, output]. */
function results(prompt: Prompt): Array<[string, { type: string; value: unknown }]> {
  const m = prompt[prompt.length - 1]!;
  assert.equal(m.role, "tool", JSON.stringify(m));
  return m.content.map((p: any) => [p.toolName, p.output]);
}

test("generateText drives bash, file and volume tools in Locker", async () => {
  const tools = lockerTools(sbx, { volume: vol });
  assert.deepEqual(Object.keys(tools).sort(), ["bash", "editFile", "readFile", "run", "writeFile"]);
  assert.match(tools.bash.description!, /no network access/);
  const model = scripted([
    () => [
      { toolName: "writeFile", input: { path: "/workspace/app.py", content: "print('v1')\nprint('v1')\n" } },
      { toolName: "bash", input: { command: "mkdir -p /workspace/out && cd /workspace/out && export STAGE=built && echo ok" } },
    ],
    (p) => {
      const r = results(p);
      assert.deepEqual(r.map(([n]) => n), ["writeFile", "bash"]);
      assert.deepEqual(r[0]![1], { type: "text", value: "File created successfully at: /workspace/app.py" });
      assert.deepEqual(r[1]![1], { type: "text", value: "ok\n" });
      return [
        { toolName: "editFile", input: { path: "/workspace/app.py", oldStr: "print('v1')", newStr: "print('v2')" } },
        { toolName: "bash", input: { command: "pwd; echo $STAGE; python3 /workspace/app.py; false" } },
      ];
    },
    (p) => {
      const [edit, bash] = results(p);
      assert.equal(edit![1].type, "error-text", JSON.stringify(edit));
      assert.match(String(edit![1].value), /occurs 2 times in \/workspace\/app.py, on lines \[1, 2\]/);
      assert.deepEqual(bash![1], { type: "text", value: "/workspace/out\nbuilt\nv1\nv1\n[exit code: 1]" });
      return [
        { toolName: "editFile", input: { path: "/workspace/app.py", oldStr: "print('v1')\nprint('v1')", newStr: "print('v2')" } },
        { toolName: "run", input: { command: "echo made > result.txt && ls" } },
      ];
    },
    (p) => {
      const [edit, run] = results(p);
      assert.match(String(edit![1].value), /has been edited/);
      const r = JSON.parse(String(run![1].value));
      assert.equal(r.exit_code, 0);
      assert.deepEqual(r.changes.added, ["/result.txt"]);
      assert.equal(r.changes.committed, true);
      return [{ toolName: "readFile", input: { path: "/workspace/app.py" } }];
    },
    (p) => {
      const view = results(p)[0]![1];
      assert.equal(view.value, "Here's the result of running `cat -n` on /workspace/app.py:\n     1\tprint('v2')");
      return "All done.";
    },
  ]);
  const out = await generateText({ model, tools, stopWhen: stepCountIs(10), prompt: "Build it." });
  assert.equal(out.text, "All done.");
  assert.equal(out.steps.length, 5);
  assert.equal(await vol.files.readText("/result.txt"), "made\n");
  assert.equal((await sbx.exec(["python3", "app.py"])).stdout, "v2\n");
});

test("stepCountIs caps a model that never stops, and an aborted call kills its command", async () => {
  const tools = lockerTools(sbx);
  const forever = () => [{ toolName: "bash", input: { command: "echo again" } }];
  const out = await generateText({ model: scripted([forever, forever, forever, forever]), tools, stopWhen: stepCountIs(3), prompt: "loop" });
  assert.equal(out.steps.length, 3);
  const ac = new AbortController();
  const started = Date.now();
  const slow = scripted([() => [{ toolName: "bash", input: { command: "sleep 30; echo late > /workspace/late.txt" } }], () => "never"]);
  setTimeout(() => ac.abort(), 1500);
  await assert.rejects(generateText({ model: slow, tools, abortSignal: ac.signal, stopWhen: stepCountIs(3), prompt: "slow" }));
  assert.ok(Date.now() - started < 20_000, "the abort ended the call");
  await new Promise((r) => setTimeout(r, 1000));
  const ps = await sbx.exec("ps -eo args | grep -c '[s]leep 30' || true");
  assert.equal(ps.stdout.trim(), "0", "the command was killed with the call");
  assert.equal(await sbx.files.exists("/workspace/late.txt"), false);
});
