// Seed 002's example, verbatim but for the import: a tool handler that runs the model's
// Python in a sandbox the conversation owns. Run: LOCKER_URL=… LOCKER_API_KEY=… node build/examples/seed002.js
import { Sandbox } from "locker-sandbox";

// Handler for a tool the model calls as run_python({ code }).
export async function runPython(sbx: Sandbox, code: string) {
  await sbx.files.write("/workspace/cell.py", code);
  const run = await sbx.exec(["python3", "cell.py"], { timeoutMs: 30_000 });
  return { exitCode: run.exitCode, stdout: run.stdout, stderr: run.stderr, timedOut: run.timedOut };
}

await using sbx = await Sandbox.create({ network: { internet: false } });
console.log(await runPython(sbx, "print(sum(range(10)))"));
