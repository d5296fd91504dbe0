// Anthropic's door: the real `@anthropic-ai/sdk` client, pointed at a stand-in of the
// Messages API that scripts the model, drives runToolLoop with the bash and text editor
// tools in a real sandbox: parallel calls answered in one message, the session's cwd and
// exported variables carried over, errors as results, a capped result saved whole in the
// sandbox, and the iteration cap.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import Anthropic from "@anthropic-ai/sdk";
import type { Sandbox } from "locker-sandbox";
import { AnthropicTools, runToolLoop, TOOL_RESULTS_DIR } from "locker-sandbox/anthropic";
import { client, unique } from "./helpers.js";
import { lastResults, messagesStandIn, toolUse } from "./standins.js";

const c = client();
let sbx: Sandbox;

before(async () => {
  sbx = await c.sandboxes.create({ metadata: { suite: unique("anthropic") } });
});
after(async () => {
  await sbx?.delete().catch(() => undefined);
});

test("a tool loop with Anthropic's bash and text editor runs in the sandbox", async () => {
  const standIn = await messagesStandIn([
    (r) => {
      assert.deepEqual(r.tools, [
        { type: "bash_20250124", name: "bash" },
        { type: "text_editor_20250728", name: "str_replace_based_edit_tool" },
      ]);
      return [
        { type: "text", text: "Setting up." },
        toolUse("bash", { command: "mkdir -p /workspace/p && cd /workspace/p && export COLOR=blue && echo ready" }),
        toolUse("str_replace_based_edit_tool", { command: "create", path: "/workspace/notes.txt", file_text: "alpha\nbeta\nalpha\n" }),
      ];
    },
    (r) => {
      const res = lastResults(r);
      assert.equal(res.length, 2, "both calls of the turn are answered in one message");
      assert.equal(res[0]!.content, "ready\n");
      assert.equal(res[1]!.content, "File created successfully at: /workspace/notes.txt");
      return [
        toolUse("bash", { command: "pwd; echo $COLOR; exit 3" }),
        toolUse("str_replace_based_edit_tool", { command: "str_replace", path: "/workspace/notes.txt", old_str: "alpha", new_str: "gamma" }),
        toolUse("no_such_tool", {}),
        toolUse("str_replace_based_edit_tool", { command: "view", path: "relative.txt" }),
      ];
    },
    (r) => {
      const [pwd, twice, unknown, relative] = lastResults(r);
      assert.equal(pwd!.content, "/workspace/p\nblue\n[exit code: 3]", "cwd and exports carried over; a non-zero exit is a result");
      assert.ok(!pwd!.is_error);
      assert.equal(twice!.is_error, true);
      assert.match(twice!.content, /occurs 2 times .* on lines \[1, 3\]/);
      assert.equal(unknown!.is_error, true);
      assert.match(unknown!.content, /Unknown tool "no_such_tool"/);
      assert.equal(relative!.is_error, true);
      assert.match(relative!.content, /not an absolute path/);
      return [
        toolUse("str_replace_based_edit_tool", { command: "str_replace", path: "/workspace/notes.txt", old_str: "beta\nalpha", new_str: "beta\ndelta" }),
        toolUse("bash", { command: "seq 1 5000" }),
      ];
    },
    (r) => {
      const [edit, big] = lastResults(r);
      assert.match(edit!.content, /has been edited/);
      assert.match(edit!.content, /\s3\tdelta/);
      assert.ok(big!.content.length < 2200, `capped: ${big!.content.length}`);
      assert.match(big!.content, /^1\n2\n/);
      assert.match(big!.content, /5000\n$/);
      assert.match(big!.content, new RegExp(`characters omitted; the full text is in ${TOOL_RESULTS_DIR}/toolu_\\d+\\.txt`));
      return [{ type: "text", text: "Done: notes edited." }];
    },
  ]);
  try {
    const anthropic = new Anthropic({ apiKey: "sk-ant-test", baseURL: standIn.url, maxRetries: 0 });
    const out = await runToolLoop({
      client: anthropic,
      model: "claude-sonnet-4-5",
      tools: new AnthropicTools(sbx),
      prompt: "Edit the notes.",
      maxResultChars: 2000,
    });
    assert.equal(out.stopReason, "done");
    assert.equal(out.finalText, "Done: notes edited.");
    assert.equal(out.iterations, 4);
    assert.equal(out.toolCalls, 8);
    assert.equal(out.toolErrors, 3);
    assert.equal(await sbx.files.readText("/workspace/notes.txt"), "alpha\nbeta\ndelta\n");
    const saved = (await sbx.files.list(TOOL_RESULTS_DIR)).map((e) => e.path);
    assert.equal(saved.length, 1);
    assert.equal((await sbx.files.readText(saved[0]!)).split("\n").length, 5001, "the whole result is kept in the sandbox");
    assert.equal(standIn.requests[0]!["model"], "claude-sonnet-4-5");
  } finally {
    await standIn.close();
  }
});

test("the loop stops at its iteration cap, and restart forgets the session", async () => {
  const tools = new AnthropicTools(sbx);
  const again = () => [toolUse("bash", { command: "cd /tmp && export N=1" })];
  const standIn = await messagesStandIn([again, again, again, again]);
  try {
    const out = await runToolLoop({
      client: new Anthropic({ apiKey: "sk-ant-test", baseURL: standIn.url, maxRetries: 0 }),
      model: "m",
      tools,
      prompt: "loop",
      maxIterations: 3,
    });
    assert.equal(out.stopReason, "max_iterations");
    assert.equal(out.iterations, 3);
    assert.equal(standIn.requests.length, 3);
  } finally {
    await standIn.close();
  }
  assert.equal((await tools.handle("bash", { command: "pwd; echo N=$N" })).content, "/tmp\nN=1\n");
  assert.equal((await tools.handle("bash", { restart: true })).content, "tool has been restarted.");
  assert.equal((await tools.handle("bash", { command: "pwd; echo N=$N" })).content, "/workspace\nN=\n");
  const bad = await tools.handle("bash", { command: "true", timeout: 5 });
  assert.equal(bad.isError, true);
  assert.match(bad.content, /valid keys are: command, restart/);
});
