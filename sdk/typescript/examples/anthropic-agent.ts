// A coding agent: Claude with Anthropic's bash and text editor tools, every call run in a
// disposable Locker sandbox, through locker-sandbox/anthropic's tool loop and the real
// @anthropic-ai/sdk client.
//
//   LOCKER_URL=… LOCKER_API_KEY=… ANTHROPIC_API_KEY=sk-ant-… node build/examples/anthropic-agent.js "task"
//   LOCKER_URL=… LOCKER_API_KEY=… node build/examples/anthropic-agent.js --offline
//
// `--offline` points the client at a local stand-in of the Messages API that plays a fixed
// script (write fib.py, run it, report), so the whole loop runs without a model.
import Anthropic from "@anthropic-ai/sdk";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { Sandbox } from "locker-sandbox";
import { AnthropicTools, runToolLoop } from "locker-sandbox/anthropic";

const offline = process.argv.includes("--offline");
const task = process.argv.slice(2).find((a) => !a.startsWith("--")) ?? "Write /workspace/fib.py with fib(n), check it with asserts, and print fib(30).";

/** The offline script: the model's turns, in order. */
const SCRIPT = [
  [{ type: "tool_use", id: "toolu_1", name: "str_replace_based_edit_tool", input: { command: "create", path: "/workspace/fib.py", file_text: "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\nassert fib(10) == 55\nprint(fib(30))\n" } }],
  [{ type: "tool_use", id: "toolu_2", name: "bash", input: { command: "cd /workspace && python3 fib.py" } }],
  [{ type: "text", text: "fib.py passes its asserts; fib(30) = 832040." }],
];

async function standIn(): Promise<{ url: string; close(): void }> {
  let turn = 0;
  const server = createServer((req, res) => {
    req.resume();
    req.on("end", () => {
      const content = SCRIPT[Math.min(turn++, SCRIPT.length - 1)];
      res.writeHead(200, { "content-type": "application/json" });
      res.end(JSON.stringify({ id: `msg_${turn}`, type: "message", role: "assistant", model: "stand-in", content, stop_reason: turn < SCRIPT.length ? "tool_use" : "end_turn", stop_sequence: null, usage: { input_tokens: 0, output_tokens: 0 } }));
    });
  });
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, close: () => server.close() };
}

const fake = offline ? await standIn() : undefined;
try {
  const anthropic = fake ? new Anthropic({ apiKey: "offline", baseURL: fake.url, maxRetries: 0 }) : new Anthropic();
  await using sbx = await Sandbox.create({ network: { internet: false }, metadata: { example: "anthropic-agent" } });
  const out = await runToolLoop({
    client: anthropic,
    model: process.env.ANTHROPIC_MODEL ?? "claude-sonnet-4-5",
    tools: new AnthropicTools(sbx),
    system: "You work in an isolated Linux sandbox with no network. Use bash and the editor; work in /workspace.",
    prompt: task,
    maxIterations: 20,
  });
  // The transcript's tool results, as the model saw them.
  for (const m of out.messages) {
    if (m.role !== "user" || !Array.isArray(m.content)) continue;
    for (const r of m.content as Array<{ content: string; is_error?: boolean }>) console.log(`[tool${r.is_error ? " error" : ""}] ${r.content.slice(0, 300)}`);
  }
  console.log(`[${out.stopReason} after ${out.iterations} model calls, ${out.toolCalls} tool calls, ${out.toolErrors} errors]`);
  console.log(out.finalText);
} finally {
  fake?.close();
}
