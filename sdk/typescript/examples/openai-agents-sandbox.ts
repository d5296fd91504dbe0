// The OpenAI Agents SDK with Locker as its sandbox provider: a SandboxAgent whose shell and
// filesystem capabilities run in a Locker sandbox made for the run from its manifest, and
// deleted after it (locker-sandbox/openai-agents).
//
//   LOCKER_URL=… LOCKER_API_KEY=… OPENAI_API_KEY=… node build/examples/openai-agents-sandbox.js "task"
//   LOCKER_URL=… LOCKER_API_KEY=… node build/examples/openai-agents-sandbox.js --offline
//
// `--offline` uses the SDK's ScriptedModel (run a command, patch a file, run it again).
import { run } from "@openai/agents";
import { SandboxAgent, file, filesystem, shell } from "@openai/agents/sandbox";
import { ScriptedModel, assistantMessage, functionCall } from "@openai/agents/testing";
import { LockerSandboxClient } from "locker-sandbox/openai-agents";

const offline = process.argv.includes("--offline");
const task = process.argv.slice(2).find((a) => !a.startsWith("--")) ?? "Make greet.py greet the world instead of nobody, then run it.";

const model = offline
  ? new ScriptedModel([
      [functionCall("exec_command", { cmd: "python3 greet.py" }, { callId: "c1" })],
      [{ type: "apply_patch_call", callId: "c2", status: "completed", operation: { type: "update_file", path: "greet.py", diff: "@@\n-print('hello, nobody')\n+print('hello, world')\n" } }],
      [functionCall("exec_command", { cmd: "python3 greet.py" }, { callId: "c3" })],
      [assistantMessage("greet.py now prints: hello, world")],
    ])
  : (process.env.OPENAI_MODEL ?? "gpt-5.5");

const agent = new SandboxAgent({
  name: "Locker workspace assistant",
  model,
  instructions: "Inspect files before changing them; run what you change.",
  capabilities: [shell(), filesystem()],
  defaultManifest: { entries: { "greet.py": file({ content: "print('hello, nobody')\n" }) } },
});

const result = await run(agent, task, {
  sandbox: { client: new LockerSandboxClient({ network: { internet: false }, metadata: { example: "openai-agents-sandbox" } }) },
});
for (const item of result.newItems) {
  if (item.type === "tool_call_output_item") console.log(`[tool] ${String(item.output).slice(0, 300)}`);
}
console.log(result.finalOutput);
