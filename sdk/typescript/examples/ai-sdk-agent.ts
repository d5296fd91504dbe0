// The Vercel AI SDK with Locker's tools: generateText gives the model bash, file and edit
// tools that run in a disposable Locker sandbox (locker-sandbox/ai).
//
//   LOCKER_URL=… LOCKER_API_KEY=… AI_GATEWAY_API_KEY=… node build/examples/ai-sdk-agent.js "task"
//   LOCKER_URL=… LOCKER_API_KEY=… node build/examples/ai-sdk-agent.js --offline
//
// The model is a gateway id (AI_MODEL, default anthropic/claude-sonnet-4.5) or any provider's
// model object; `--offline` uses a scripted stand-in (the AI SDK's MockLanguageModelV3).
import { generateText, stepCountIs, type LanguageModel } from "ai";
import { MockLanguageModelV3 } from "ai/test";
import { Sandbox } from "locker-sandbox";
import { lockerTools } from "locker-sandbox/ai";

const offline = process.argv.includes("--offline");
const task = process.argv.slice(2).find((a) => !a.startsWith("--")) ?? "Write /workspace/hello.py that prints the sum of 1..100, and run it.";

function scripted(): LanguageModel {
  const usage = { inputTokens: { total: 0, noCache: 0, cacheRead: 0, cacheWrite: 0 }, outputTokens: { total: 0, text: 0, reasoning: 0 } };
  const call = (id: string, toolName: string, input: unknown) => ({ type: "tool-call" as const, toolCallId: id, toolName, input: JSON.stringify(input) });
  const steps = [
    [call("c1", "writeFile", { path: "/workspace/hello.py", content: "print(sum(range(1, 101)))\n" })],
    [call("c2", "bash", { command: "cd /workspace && python3 hello.py" })],
  ];
  let i = 0;
  return new MockLanguageModelV3({
    doGenerate: async () => {
      const step = steps[i++];
      if (step) return { content: step, finishReason: { unified: "tool-calls", raw: "tool_calls" }, usage, warnings: [] };
      return { content: [{ type: "text", text: "hello.py prints 5050." }], finishReason: { unified: "stop", raw: "stop" }, usage, warnings: [] };
    },
  });
}

await using sbx = await Sandbox.create({ network: { internet: false }, metadata: { example: "ai-sdk-agent" } });
const { text, steps } = await generateText({
  model: offline ? scripted() : (process.env.AI_MODEL ?? "anthropic/claude-sonnet-4.5"),
  tools: lockerTools(sbx),
  stopWhen: stepCountIs(20),
  system: "You work in an isolated Linux sandbox with no network; work in /workspace.",
  prompt: task,
});
for (const r of steps.flatMap((s) => s.toolResults)) console.log(`[${r.toolName}] ${String(r.output).slice(0, 300)}`);
const calls = steps.flatMap((s) => s.toolCalls.map((c) => c.toolName));
console.log(`[${steps.length} steps; tools: ${calls.join(", ") || "none"}]`);
console.log(text);
