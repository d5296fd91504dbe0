/**
 * The Vercel AI SDK's door (`locker-sandbox/ai`): Locker's sandbox tools as AI SDK
 * `tool()` definitions with zod schemas, for `generateText`/`streamText`/`Agent`:
 *
 *     import { generateText, stepCountIs } from "ai";
 *     import { lockerTools } from "locker-sandbox/ai";
 *     await using sbx = await Sandbox.create();
 *     const { text } = await generateText({ model, tools: lockerTools(sbx), stopWhen: stepCountIs(20), prompt });
 *
 * Tools: `bash` (a session: cwd and exported variables carry over), `readFile`,
 * `writeFile`, `editFile` (old_str exactly once), and with options `runCode` (Python cells
 * on a code context, `code: true`, template `code-interpreter`) and `run` (a serverless
 * run on `volume`, with its change list). A failed call throws an Error whose message is
 * written for the model (the AI SDK sends it back as the tool's error); a command that
 * exits non-zero is a result. `ai` and `zod` are peer dependencies, needed only here.
 */

import { tool, type Tool } from "ai";
import { z } from "zod";
import type { Sandbox } from "./sandbox.js";
import type { Volume, CommitMode } from "./volume.js";
import type { CodeContext } from "./code.js";
import { BashSession, CodeCells, RUN_CODE_DESCRIPTION, TextEditor, ToolFailure, errorText, runOnVolume, type BashOptions, type EditorOptions } from "./tools.js";

export interface LockerToolsOptions {
  bash?: BashOptions;
  editor?: EditorOptions;
  /** Add `runCode` (a context made on first use, or this one). */
  code?: boolean | CodeContext;
  /** Add `run`: serverless runs on this volume. */
  volume?: Volume;
  /** The commit mode of `run` (default "on_success"). */
  commit?: CommitMode;
}

/** The tools, by name (`runCode` and `run` only when asked for). */
export type LockerToolSet = Record<"bash" | "readFile" | "writeFile" | "editFile", Tool<any, string>> & Record<string, Tool<any, string>>;

/** Runs a tool body; a failure becomes an Error whose message is for the model. */
async function attempt(name: string, f: () => Promise<string>): Promise<string> {
  try {
    return await f();
  } catch (e) {
    throw new Error(errorText(name, e), { cause: e instanceof ToolFailure ? undefined : e });
  }
}

function networkNote(sbx: Sandbox): string {
  const n = sbx.info.network;
  if (!n) return "";
  if (n.egress === "none") return " The sandbox has no network access.";
  if (n.egress === "allow") return ` The sandbox reaches only these hosts: ${(n.allow ?? []).join(", ")}.`;
  return " The sandbox has internet access.";
}

/** Locker's tools for the AI SDK, bound to `sbx`: `bash`, `readFile`, `writeFile`, `editFile`, and `runCode`/`run` when asked for. */
export function lockerTools(sbx: Sandbox, opts: LockerToolsOptions = {}): LockerToolSet {
  const bash = new BashSession(sbx, opts.bash);
  const editor = new TextEditor(sbx.files, opts.editor);
  const base = {
    bash: tool({
      description:
        `Run a bash command in an isolated Linux sandbox (${bash.cwd} to start). The working directory and exported ` +
        `variables carry over to the next command, as in a terminal; stderr is merged into stdout. A non-zero exit is ` +
        `reported as [exit code: N]; commands are killed after ${bash.timeoutMs / 1000} s.` +
        networkNote(sbx),
      inputSchema: z.object({
        command: z.string().optional().describe("The command line to run."),
        restart: z.boolean().optional().describe("true: start a fresh session (working directory and variables forgotten)."),
      }),
      execute: ({ command, restart }, { abortSignal }) =>
        attempt("bash", () => (restart ? bash.restart() : bash.run(command ?? "", { signal: abortSignal }))),
    }),
    readFile: tool({
      description: "Read a text file of the sandbox with line numbers (cat -n), or list a directory 2 levels deep.",
      inputSchema: z.object({
        path: z.string().describe("Absolute path, e.g. /workspace/main.py."),
        viewRange: z.array(z.number().int()).length(2).optional().describe("[start_line, end_line], 1-based; end -1 for the end."),
      }),
      execute: ({ path, viewRange }) => attempt("readFile", () => editor.call({ command: "view", path, view_range: viewRange })),
    }),
    writeFile: tool({
      description: "Create or replace a file in the sandbox with the given content (parent directories are made).",
      inputSchema: z.object({
        path: z.string().describe("Absolute path."),
        content: z.string().describe("The whole content of the file."),
      }),
      execute: ({ path, content }) => attempt("writeFile", () => editor.call({ command: "create", path, file_text: content })),
    }),
    editFile: tool({
      description:
        "Replace one exact occurrence of oldStr with newStr in a file of the sandbox. oldStr must occur exactly once, " +
        "whitespace included; otherwise nothing changes and the error says how many times and on which lines it occurs.",
      inputSchema: z.object({
        path: z.string().describe("Absolute path."),
        oldStr: z.string().describe("The exact text to replace."),
        newStr: z.string().describe("The text to put instead (empty deletes)."),
      }),
      execute: ({ path, oldStr, newStr }) => attempt("editFile", () => editor.call({ command: "str_replace", path, old_str: oldStr, new_str: newStr })),
    }),
  };
  const tools: LockerToolSet = base;
  const cells = opts.code ? new CodeCells(sbx, typeof opts.code === "object" ? opts.code : undefined) : undefined;
  if (cells) {
    tools["runCode"] = tool({
          description: RUN_CODE_DESCRIPTION,
          inputSchema: z.object({
            code: z.string().describe("Python source to run, as in a notebook cell."),
            timeoutMs: z.number().int().min(1).max(600_000).optional().describe("Wall-clock limit in milliseconds (default 60000)."),
          }),
          execute: ({ code, timeoutMs }) => attempt("runCode", () => cells.run(code, timeoutMs)),
    });
  }
  const volume = opts.volume;
  if (volume) {
    tools["run"] = tool({
          description:
            `Run a shell command in a fresh machine on the persistent volume "${volume.name}" (mounted as the working ` +
            `directory). Its file changes are committed ${opts.commit === "always" ? "always" : opts.commit === "never" ? "never" : "when it exits 0"}; ` +
            "the result lists what it added, modified and deleted, and any conflicts with concurrent runs.",
          inputSchema: z.object({
            command: z.string().describe("The command line, run by /bin/sh -c."),
            timeoutMs: z.number().int().min(1).optional().describe("Killed after this long (default 60000)."),
          }),
          execute: ({ command, timeoutMs }) => attempt("run", () => runOnVolume(volume, command, { commit: opts.commit, timeoutMs })),
    });
  }
  return tools;
}
