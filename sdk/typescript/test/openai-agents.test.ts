// The OpenAI Agents SDK's door: the real `@openai/agents` package runs a SandboxAgent whose
// shell and filesystem capabilities are backed by LockerSandboxClient (the SDK's sandbox
// provider interface), and an ordinary Agent with lockerAgentTools, each driven by the SDK's
// own ScriptedModel (no model API is reachable here). The manifest's files are written in
// the sandbox, commands and patches run there, and the run deletes the sandbox it made.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Agent, run } from "@openai/agents";
import { SandboxAgent, dir, file, filesystem, shell } from "@openai/agents/sandbox";
import { ScriptedModel, assistantMessage, functionCall, modelResponder } from "@openai/agents/testing";
import { NotFound } from "locker-sandbox";
import { LockerSandboxClient, LockerSandboxSession, lockerAgentTools } from "locker-sandbox/openai-agents";
import { client, unique } from "./helpers.js";

const c = client();

/** The output the model was sent for its last function call. */
function lastOutput(input: unknown): string {
  const items = (Array.isArray(input) ? input : []) as Array<Record<string, any>>;
  const out = [...items].reverse().find((i) => /^(function_call_result|function_call_output|apply_patch_call_output)$/.test(i["type"]));
  assert.ok(out, `a function call's output in ${JSON.stringify(items).slice(0, 2000)}`);
  if (out["type"] === "apply_patch_call_output") return `${out["status"]}: ${out["output"] ?? ""}`;
  const o = out["output"];
  return typeof o === "string" ? o : o?.text ?? JSON.stringify(o);
}

class RecordingClient extends LockerSandboxClient {
  sessions: LockerSandboxSession[] = [];
  override async create(...args: Parameters<LockerSandboxClient["create"]>) {
    const s = await super.create(...args);
    this.sessions.push(s);
    return s;
  }
}

test("a SandboxAgent runs its shell and filesystem capabilities in a Locker sandbox", async () => {
  const suite = unique("agents");
  const seen: string[] = [];
  const model = new ScriptedModel([
    modelResponder(({ request }) => {
      seen.push(...(request.tools ?? []).map((t: { name: string }) => t.name));
      return [functionCall("exec_command", { cmd: "pwd && cat README.md && python3 src/app.py && echo $GREETING" }, { callId: "c1" })];
    }),
    modelResponder(({ request }) => {
      const out = lastOutput(request.input);
      assert.match(out, /Process exited with code 0/);
      assert.match(out, /Output:\n\/work\/agent\nhello from the manifest\nv1\nhi\n/);
      assert.ok(seen.includes("apply_patch"), seen.join(", "));
      return [
        {
          type: "apply_patch_call" as const,
          callId: "c2",
          status: "completed" as const,
          operation: { type: "update_file" as const, path: "src/app.py", diff: "@@\n-print('v1')\n+print('v2')\n" },
        },
      ];
    }),
    modelResponder(({ request }) => {
      assert.equal(lastOutput(request.input), "completed: Updated src/app.py");
      return [functionCall("exec_command", { cmd: "python3 src/app.py; exit 3", login: false }, { callId: "c3" })];
    }),
    modelResponder(({ request }) => {
      const out = lastOutput(request.input);
      assert.match(out, /Process exited with code 3/);
      assert.match(out, /Output:\nv2\n/);
      return [assistantMessage("patched")];
    }),
  ]);
  const agent = new SandboxAgent({
    name: "locker-test",
    model,
    instructions: "Work in the sandbox.",
    capabilities: [shell(), filesystem()],
    defaultManifest: {
      root: "/work/agent",
      entries: {
        "README.md": file({ content: "hello from the manifest\n" }),
        src: dir({ children: { "app.py": file({ content: "print('v1')\n" }) } }),
      },
      environment: { GREETING: "hi" },
    },
  });
  const sandboxes = new RecordingClient({ metadata: { suite } });
  const result = await run(agent, "Patch app.py to print v2.", { sandbox: { client: sandboxes } });
  assert.equal(result.finalOutput, "patched", `tools: ${seen.join(", ")}`);
  assert.ok(seen.includes("exec_command"), seen.join(", "));
  assert.equal(sandboxes.sessions.length, 1);
  const id = sandboxes.sessions[0]!.sandbox.id;
  await assert.rejects(c.sandboxes.get(id), NotFound, "the run deleted the sandbox it made");
  model.assertComplete();
});

test("the client's sessions read, list, edit and refuse what they cannot materialize", async () => {
  const sandboxes = new LockerSandboxClient({ metadata: { suite: unique("agents-session") } });
  const s = await sandboxes.create({ manifest: { entries: { "a.txt": file({ content: "one\ntwo\n" }) } } });
  try {
    assert.equal(s.state.manifest.root, "/workspace");
    assert.equal(new TextDecoder().decode(await s.readFile({ path: "a.txt" })), "one\ntwo\n");
    assert.deepEqual((await s.listDir({ path: "." })).map((e) => [e.name, e.type]), [["a.txt", "file"]]);
    assert.equal(await s.pathExists("a.txt"), true);
    assert.equal(await s.directoryExists("a.txt"), false);
    const ed = s.createEditor();
    await ed.updateFile({ path: "a.txt", diff: "@@\n one\n-two\n+three\n" });
    await ed.createFile({ path: "b/new.txt", diff: "+made\n" });
    assert.equal(await s.sandbox.files.readText("/workspace/a.txt"), "one\nthree\n");
    assert.equal(await s.sandbox.files.readText("/workspace/b/new.txt"), "made");
    assert.equal((await ed.deleteFile({ path: "nope.txt" })).status, "failed");
    assert.equal((await ed.updateFile({ path: "b/new.txt", diff: "@@\n-made\n+moved\n", moveTo: "c.txt" }))?.status, "completed");
    assert.equal(await s.sandbox.files.readText("/workspace/c.txt"), "moved");
    assert.equal(await s.pathExists("b/new.txt"), false);
    const r = await s.exec({ cmd: "seq 1 2000", maxOutputTokens: 50 });
    assert.equal(r.exitCode, 0);
    assert.ok(r.output.length < 400 && r.originalTokenCount! > 50, r.output);
    const again = await sandboxes.resume(s.state);
    assert.equal(again.sandbox.id, s.sandbox.id);
    await assert.rejects(
      sandboxes.create({ manifest: { entries: { repo: { type: "git_repo", repo: "openai/x" } as never } } }),
      /cannot materialize a manifest entry of type "git_repo"/,
    );
  } finally {
    await s.delete();
  }
  assert.equal(await s.running(), false);
});

test("an ordinary Agent calls lockerAgentTools; failures go back to the model as text", async () => {
  await using sbx = await c.sandboxes.create({ metadata: { suite: unique("agents-tools") } });
  const model = new ScriptedModel([
    [functionCall("write_file", { path: "/workspace/x.txt", content: "a\na\n" }, { callId: "t1" })],
    modelResponder(({ request }) => {
      assert.match(lastOutput(request.input), /File created successfully/);
      return [functionCall("edit_file", { path: "/workspace/x.txt", old_str: "a", new_str: "b" }, { callId: "t2" })];
    }),
    modelResponder(({ request }) => {
      assert.match(lastOutput(request.input), /^Error: No replacement was performed: old_str occurs 2 times/);
      return [functionCall("bash", { command: "cd /tmp && export K=v && wc -l < /workspace/x.txt" }, { callId: "t3" })];
    }),
    modelResponder(({ request }) => {
      assert.equal(lastOutput(request.input), "2\n");
      return [functionCall("bash", { command: "pwd; echo $K" }, { callId: "t4" })];
    }),
    modelResponder(({ request }) => {
      assert.equal(lastOutput(request.input), "/tmp\nv\n");
      return [assistantMessage("two lines")];
    }),
  ]);
  const agent = new Agent({ name: "tools", model, tools: lockerAgentTools(sbx) });
  const result = await run(agent, "Count the lines.");
  assert.equal(result.finalOutput, "two lines");
  model.assertComplete();
});
