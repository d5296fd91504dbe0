// The run_code tool of the frameworks' doors on the code-interpreter template: Anthropic's
// tool loop (the real @anthropic-ai/sdk client, a stand-in of the Messages API) and the AI
// SDK's generateText (a scripted model) keep one context per sandbox: a DataFrame made in
// one call is there in the next; an exception is a result to read, not a tool failure; a
// chart counts as an image.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import Anthropic from "@anthropic-ai/sdk";
import { generateText, stepCountIs } from "ai";
import { MockLanguageModelV3 } from "ai/test";
import type { Sandbox } from "locker-sandbox";
import { AnthropicTools, runToolLoop } from "locker-sandbox/anthropic";
import { lockerTools } from "locker-sandbox/ai";
import { client, unique } from "../helpers.js";
import { lastResults, messagesStandIn, toolUse } from "../standins.js";

const c = client();
let sbx: Sandbox;

before(async () => {
  sbx = await c.sandboxes.create({ template: "code-interpreter", ttlSeconds: 900, metadata: { suite: unique("code-tools") } });
});
after(async () => {
  await sbx?.delete().catch(() => undefined);
});

test("Anthropic's tool loop runs the seed's run_code tool with state kept between calls", async () => {
  const standIn = await messagesStandIn([
    (r) => {
      assert.ok(r.tools!.some((t: { name: string }) => t.name === "run_code"), JSON.stringify(r.tools));
      return [toolUse("run_code", { code: "import pandas as pd\ndf = pd.DataFrame({'v': [1, 2, 3]})\nprint('rows', len(df))" })];
    },
    (r) => {
      const [res] = lastResults(r);
      assert.equal(JSON.parse(res!.content).stdout, "rows 3\n");
      return [toolUse("run_code", { code: "print(df['v'].sum())\n1 / 0" })];
    },
    (r) => {
      const [res] = lastResults(r);
      const out = JSON.parse(res!.content);
      assert.equal(out.stdout, "6\n", "df persisted from the first call");
      assert.equal(out.error.name, "ZeroDivisionError");
      assert.ok(!res!.is_error, "an exception is a result to read, not a tool failure");
      return [toolUse("run_code", { code: "import matplotlib.pyplot as plt\nplt.plot(df['v'])\nplt.show()" })];
    },
    (r) => {
      assert.equal(JSON.parse(lastResults(r)[0]!.content).images, 1);
      return [{ type: "text", text: "The sum is 6." }];
    },
  ]);
  try {
    const out = await runToolLoop({
      client: new Anthropic({ apiKey: "sk-ant-test", baseURL: standIn.url, maxRetries: 0 }),
      model: "m",
      tools: new AnthropicTools(sbx, { code: true }),
      prompt: "Sum the data.",
    });
    assert.equal(out.finalText, "The sum is 6.");
    assert.equal(out.toolCalls, 3);
    assert.equal(out.toolErrors, 0);
  } finally {
    await standIn.close();
  }
});

test("the AI SDK's runCode tool keeps its context between steps", async () => {
  const usage = { inputTokens: { total: 1, noCache: 1, cacheRead: 0, cacheWrite: 0 }, outputTokens: { total: 1, text: 1, reasoning: 0 } };
  const seen: unknown[] = [];
  let i = 0;
  const steps = [
    [{ type: "tool-call" as const, toolCallId: "k1", toolName: "runCode", input: JSON.stringify({ code: "x = 20" }) }],
    [{ type: "tool-call" as const, toolCallId: "k2", toolName: "runCode", input: JSON.stringify({ code: "x + 22" }) }],
  ];
  const model = new MockLanguageModelV3({
    doGenerate: async ({ prompt }) => {
      const last = prompt[prompt.length - 1]!;
      if (last.role === "tool") seen.push(...last.content.map((p) => (p as { output: { value: unknown } }).output.value));
      const step = steps[i++];
      if (step) return { content: step, finishReason: { unified: "tool-calls", raw: "tool_calls" }, usage, warnings: [] };
      return { content: [{ type: "text", text: "42" }], finishReason: { unified: "stop", raw: "stop" }, usage, warnings: [] };
    },
  });
  const out = await generateText({ model, tools: lockerTools(sbx, { code: true }), stopWhen: stepCountIs(5), prompt: "x" });
  assert.equal(out.text, "42");
  assert.equal(JSON.parse(String(seen[1])).result, "42", JSON.stringify(seen));
});
