/**
 * The tools agents get from a sandbox, independent of any framework: a bash session whose
 * working directory and exported variables carry over between commands, a text editor
 * (view, create, exact-once `str_replace`, insert), file read/write, Python cells on a code
 * context, serverless runs on a volume. Each call answers text for a model; a call that
 * could not be done is a `ToolFailure` (its message says what to do next), a command that
 * exits non-zero is not a failure. The framework doors (`locker-sandbox/ai`,
 * `/anthropic`, `/openai-agents`) wrap these; they import nothing but this package.
 *
 * Owns the model-facing texts; it adds no route (everything goes through `Sandbox`,
 * `Files`, `Volume`).
 */

import { LockerError, NotFound } from "./errors.js";
import type { Sandbox } from "./sandbox.js";
import type { Files } from "./files.js";
import type { Volume, CommitMode } from "./volume.js";
import type { CodeContext } from "./code.js";
import type { ExecResult } from "./types.js";

/** A tool call that could not be done; the message is written for the model. */
export class ToolFailure extends Error {
  override name = "ToolFailure";
}

/** What a tool answers: text for the model, and whether the call failed. */
export interface ToolOutput {
  content: string;
  isError: boolean;
}

/** Runs `f`; a ToolFailure or a platform error becomes an error result, never a throw. */
export async function asToolOutput(tool: string, f: () => Promise<string>): Promise<ToolOutput> {
  try {
    return { content: await f(), isError: false };
  } catch (e) {
    return { content: errorText(tool, e), isError: true };
  }
}

/** The text of an error for the model. */
export function errorText(tool: string, e: unknown): string {
  if (e instanceof ToolFailure) return e.message;
  if (e instanceof LockerError) return `${tool} failed: the sandbox platform answered ${e.status || "nothing"} ${e.code}: ${e.message}`;
  return `${tool} failed: ${e instanceof Error ? e.message : String(e)}`;
}

/** `text` cut to `max` characters keeping its head (2/3) and tail (1/3), with a note of what was left out. */
export function capText(text: string, max: number, where?: string): string {
  if (text.length <= max) return text;
  const head = Math.floor((max * 2) / 3);
  const tail = max - head;
  const omitted = text.length - head - tail;
  const note = where ? `; the full text is in ${where}` : "";
  return `${text.slice(0, head)}\n…[locker: ${omitted} characters omitted${note}]…\n${text.slice(text.length - tail)}`;
}

/** An ExecResult as terminal-like text: the output, then a note when it did not exit 0. */
export function formatExec(r: ExecResult, timeoutMs?: number, merged = true): string {
  let out = r.stdout;
  if (!merged && r.stderr) out = out ? out + (out.endsWith("\n") ? "" : "\n") + r.stderr : r.stderr;
  const notes: string[] = [];
  if (r.stdoutTruncated || (!merged && r.stderrTruncated)) {
    notes.push(
      `[output truncated: ${r.stdoutBytes + (merged ? 0 : r.stderrBytes)} bytes in all, the middle left out; the full output is in ${r.outputPath} in the sandbox: read parts of it with head, tail, sed -n or grep]`,
    );
  }
  if (r.reason === "timeout") {
    const after = timeoutMs ? ` after ${timeoutMs / 1000} s` : "";
    notes.push(`[the command timed out${after} and was killed with everything it started. Split long work into shorter steps that save their progress to files]`);
  } else if (r.reason === "oom") {
    notes.push("[the command ran out of memory and was killed]");
  } else if (r.reason === "signaled" || r.reason === "killed") {
    notes.push(`[the command was killed by ${r.signal ?? "a signal"}]`);
  } else if (r.reason === "output_limit") {
    notes.push("[the command was stopped: it produced more output than the sandbox can keep]");
  } else if (r.exitCode !== 0 && r.exitCode !== null) {
    notes.push(`[exit code: ${r.exitCode}]`);
  }
  let text = out;
  if (notes.length) text = (text && !text.endsWith("\n") ? text + "\n" : text) + notes.join("\n");
  return text || "(no output)";
}

function shellQuote(s: string): string {
  return `'${s.replace(/'/g, `'\\''`)}'`;
}

export interface BashOptions {
  /** Per command (default 120 000). */
  timeoutMs?: number;
  /** Output kept (default 30 000 bytes, head and tail). */
  maxOutputBytes?: number;
  /** Where the first command starts (default the sandbox's workdir, else /root). */
  cwd?: string;
  env?: Record<string, string>;
}

/**
 * A bash session in a sandbox: each command runs in a fresh bash, but the working directory
 * and exported variables carry over (kept in the sandbox under /tmp/.locker-bash/), as in a
 * terminal. stderr is merged into stdout in order.
 */
export class BashSession {
  private stateDir = BashSession.newStateDir();
  readonly timeoutMs: number;
  readonly maxOutputBytes: number;
  readonly cwd: string;

  constructor(
    readonly sandbox: Sandbox,
    private readonly opts: BashOptions = {},
  ) {
    this.timeoutMs = opts.timeoutMs ?? 120_000;
    this.maxOutputBytes = opts.maxOutputBytes ?? 30_000;
    this.cwd = opts.cwd ?? sandbox.workdir ?? "/root";
  }

  private static newStateDir(): string {
    return `/tmp/.locker-bash/${Math.random().toString(36).slice(2, 10)}${Date.now().toString(36)}`;
  }

  private script(command: string): string {
    const d = shellQuote(this.stateDir);
    const cwd = shellQuote(this.cwd);
    return [
      `__locker_d=${d}`,
      'mkdir -p "$__locker_d"',
      '[ -f "$__locker_d/env" ] && . "$__locker_d/env"',
      `cd "$(cat "$__locker_d/cwd" 2>/dev/null || echo ${cwd})" 2>/dev/null || cd ${cwd} 2>/dev/null || cd /`,
      "__locker_save() {",
      "  __locker_rc=$?",
      '  pwd > "$__locker_d/cwd"',
      "  export -p | grep -v -E '^declare -x (PWD|OLDPWD|SHLVL|_)(=|$)' > \"$__locker_d/env\"",
      '  exit "$__locker_rc"',
      "}",
      "trap __locker_save EXIT",
      "exec 2>&1",
      command,
      "",
    ].join("\n");
  }

  /** Runs `command`; the result as terminal text (a non-zero exit is said in it). */
  async run(command: string, opts: { signal?: AbortSignal } = {}): Promise<string> {
    if (typeof command !== "string" || !command.trim()) {
      throw new ToolFailure('no command provided: send {"command": "..."} (or {"restart": true}).');
    }
    const r = await this.sandbox.exec(["bash", "-c", this.script(command)], {
      cwd: "/",
      timeoutMs: this.timeoutMs,
      maxOutputBytes: this.maxOutputBytes,
      env: this.opts.env,
      signal: opts.signal,
    });
    return formatExec(r, this.timeoutMs);
  }

  /** A fresh session: the working directory and variables are forgotten. */
  async restart(): Promise<string> {
    const old = this.stateDir;
    this.stateDir = BashSession.newStateDir();
    await this.sandbox.exec(["rm", "-rf", old], { cwd: "/", timeoutMs: 10_000 }).catch(() => undefined);
    return "tool has been restarted.";
  }
}

/** `cat -n`: the line number right-aligned in 6 columns, a tab, the line. */
export function numbered(text: string, start = 1): string {
  const lines = text.split("\n");
  if (lines.length && lines[lines.length - 1] === "") lines.pop();
  return lines.map((l, i) => `${String(i + start).padStart(6)}\t${l}`).join("\n");
}

function splitLines(text: string): string[] {
  const lines = text.split("\n");
  if (lines.length > 1 && lines[lines.length - 1] === "") lines.pop();
  return lines;
}

function lineOf(text: string, idx: number): number {
  let n = 1;
  for (let i = text.indexOf("\n"); i >= 0 && i < idx; i = text.indexOf("\n", i + 1)) n++;
  return n;
}

/** Replaces the one occurrence of `oldStr`: the new text and the line where it starts. */
export function replaceOnce(text: string, path: string, oldStr: unknown, newStr: unknown): { text: string; line: number } {
  if (typeof oldStr !== "string" || oldStr === "") {
    throw new ToolFailure("old_str is required and must not be empty: give the exact text to replace, including its whitespace and indentation.");
  }
  if (newStr !== undefined && newStr !== null && typeof newStr !== "string") throw new ToolFailure("new_str must be a string.");
  const at: number[] = [];
  for (let i = text.indexOf(oldStr); i >= 0; i = text.indexOf(oldStr, i + 1)) at.push(i);
  if (at.length === 0) {
    const hint = oldStr.trim() && text.includes(oldStr.trim())
      ? " The text occurs with different leading/trailing whitespace or indentation: copy it exactly from a fresh view of the file."
      : "";
    throw new ToolFailure(`No replacement was performed: old_str did not appear verbatim in ${path}.${hint} Matching is exact, whitespace included. View the file and copy the text exactly.`);
  }
  if (at.length > 1) {
    throw new ToolFailure(
      `No replacement was performed: old_str occurs ${at.length} times in ${path}, on lines [${at.map((i) => lineOf(text, i)).join(", ")}]. It must occur exactly once: include more surrounding lines to make it unique.`,
    );
  }
  const i = at[0]!;
  return { text: text.slice(0, i) + ((newStr as string | undefined) ?? "") + text.slice(i + oldStr.length), line: lineOf(text, i) };
}

function snippet(text: string, line: number, inserted: string, around = 4): string {
  const lines = splitLines(text);
  const first = Math.max(1, line - around);
  const last = Math.min(lines.length, line + (inserted.match(/\n/g)?.length ?? 0) + around);
  return numbered(lines.slice(first - 1, last).join("\n") + "\n", first);
}

/** A file's text; a missing file, a directory or bytes that are not UTF-8 are ToolFailures. */
export async function readTextFile(files: Files, path: string): Promise<string> {
  let data: Uint8Array;
  try {
    data = await files.read(path);
  } catch (e) {
    if (e instanceof NotFound) throw new ToolFailure(`The path ${path} does not exist. Check the path (list the directory to see what is there).`);
    if (e instanceof LockerError && e.status === 400 && /director/i.test(e.message)) throw new ToolFailure(`The path ${path} is a directory, not a file.`);
    throw e;
  }
  try {
    return new TextDecoder("utf-8", { fatal: true }).decode(data);
  } catch {
    throw new ToolFailure(`The file ${path} is not UTF-8 text (${data.length} bytes); it cannot be viewed or edited as text.`);
  }
}

async function writeKeepingMode(files: Files, path: string, text: string): Promise<void> {
  let mode: string | undefined;
  try {
    mode = ((await files.stat(path)).mode & 0o7777).toString(8).padStart(4, "0");
  } catch {
    mode = undefined;
  }
  await files.write(path, text, { mode });
}

function absolute(path: unknown): string {
  if (typeof path !== "string" || !path) throw new ToolFailure("`path` is required: an absolute path such as /workspace/main.py.");
  if (!path.startsWith("/")) throw new ToolFailure(`The path ${path} is not an absolute path: it should start with \`/\` (for example /workspace/${path}).`);
  return path;
}

export interface EditorOptions {
  /** Caps what `view` returns. */
  maxCharacters?: number;
  /** `create` may replace an existing file (default true). */
  allowOverwrite?: boolean;
}

/** The keys of Anthropic's text editor input. */
export const EDITOR_KEYS = ["command", "path", "view_range", "file_text", "old_str", "new_str", "insert_line", "insert_text"] as const;

/**
 * A text editor on a sandbox's or a volume's files, as Anthropic's `text_editor_20250728`
 * defines it: `view` (a file with line numbers and `view_range`, a directory 2 levels deep
 * without hidden items), `create`, `str_replace` (old_str exactly once), `insert`.
 */
export class TextEditor {
  constructor(
    readonly files: Files,
    readonly opts: EditorOptions = {},
  ) {}

  /** One call: its text, or a ToolFailure. */
  async call(input: Record<string, unknown>): Promise<string> {
    const unknown = Object.keys(input).filter((k) => !(EDITOR_KEYS as readonly string[]).includes(k)).sort();
    if (unknown.length) throw new ToolFailure(`str_replace_based_edit_tool: unknown input key(s) ${JSON.stringify(unknown)}; the valid keys are: ${EDITOR_KEYS.join(", ")}.`);
    const command = input["command"];
    if (command === "undo_edit") throw new ToolFailure("undo_edit is not available in this version of the tool. To revert an edit, str_replace the new text back with the old.");
    if (command !== "view" && command !== "create" && command !== "str_replace" && command !== "insert") {
      throw new ToolFailure(`Unknown command ${JSON.stringify(command)}: use view, create, str_replace or insert.`);
    }
    const path = absolute(input["path"]);
    switch (command) {
      case "view":
        return this.view(path, input["view_range"]);
      case "create":
        return this.create(path, input["file_text"]);
      case "str_replace":
        return this.strReplace(path, input["old_str"], input["new_str"]);
      case "insert":
        return this.insert(path, input["insert_line"], input["insert_text"] ?? input["new_str"]);
    }
  }

  async view(path: string, range?: unknown): Promise<string> {
    let entry;
    try {
      entry = await this.files.stat(path);
    } catch (e) {
      if (e instanceof NotFound) throw new ToolFailure(`The path ${path} does not exist.`);
      throw e;
    }
    if (entry.type === "dir") {
      if (range !== undefined && range !== null) throw new ToolFailure("view_range is for files; the path is a directory.");
      const base = path.replace(/\/+$/, "");
      const rows = (await this.files.list(path, { depth: 2 }))
        .filter((e) => !e.path.slice(base.length).split("/").some((p) => p.startsWith(".")))
        .map((e) => `${String(e.size).padStart(8)}  ${e.path}${e.type === "dir" ? "/" : ""}`);
      return `Here are the files and directories up to 2 levels deep in ${path}, excluding hidden items:\n${rows.length ? rows.join("\n") : "(empty)"}`;
    }
    const text = await readTextFile(this.files, path);
    let part = text;
    let first = 1;
    if (range !== undefined && range !== null) {
      if (!Array.isArray(range) || range.length !== 2 || !range.every((x) => Number.isInteger(x))) {
        throw new ToolFailure("view_range must be a list of two integers: [start_line, end_line] (1-based, end_line -1 for the end of the file).");
      }
      const lines = text ? splitLines(text) : [];
      const n = lines.length;
      let [start, end] = range as [number, number];
      if (start < 1 || start > Math.max(n, 1)) throw new ToolFailure(`Invalid view_range [${start}, ${end}]: start_line ${start} is outside the file's lines [1, ${n}].`);
      if (end === -1) end = n;
      if (end < start) throw new ToolFailure(`Invalid view_range [${start}, ${end}]: end_line ${end} is before start_line ${start} (use -1 for the end of the file).`);
      end = Math.min(end, n);
      part = lines.slice(start - 1, end).join("\n") + (end > start - 1 ? "\n" : "");
      first = start;
    }
    let out = part ? numbered(part, first) : "";
    const max = this.opts.maxCharacters;
    if (max && out.length > max) {
      let shown = out.slice(0, max);
      if (shown.includes("\n")) shown = shown.slice(0, shown.lastIndexOf("\n") + 1);
      const last = first + (shown.match(/\n/g)?.length ?? 0) - 1;
      out = `${shown}[the view was cut at ${max} characters, after line ${last}: view the rest with view_range [${last + 1}, -1]]`;
    }
    if (!out) return text ? `No lines in that range of ${path}.` : `The file ${path} is empty.`;
    return `Here's the result of running \`cat -n\` on ${path}:\n${out}`;
  }

  async create(path: string, fileText: unknown): Promise<string> {
    if (typeof fileText !== "string") throw new ToolFailure("create needs `file_text`: the whole content of the new file.");
    let existed = false;
    try {
      const e = await this.files.stat(path);
      if (e.type === "dir") throw new ToolFailure(`The path ${path} is a directory.`);
      existed = true;
    } catch (e) {
      if (!(e instanceof NotFound)) throw e;
    }
    if (existed && this.opts.allowOverwrite === false) {
      throw new ToolFailure(`File already exists at ${path}; create does not overwrite files. Edit it with str_replace or insert.`);
    }
    await this.files.write(path, fileText);
    return `File ${existed ? "overwritten" : "created"} successfully at: ${path}`;
  }

  async strReplace(path: string, oldStr: unknown, newStr: unknown): Promise<string> {
    const text = await readTextFile(this.files, path);
    const { text: updated, line } = replaceOnce(text, path, oldStr, newStr);
    await writeKeepingMode(this.files, path, updated);
    return `The file ${path} has been edited. Here's the result of running \`cat -n\` on a snippet of ${path}:\n${snippet(updated, line, (newStr as string) ?? "")}\nReview the changes and make sure they are as expected. Edit the file again if necessary.`;
  }

  async insert(path: string, insertLine: unknown, newText: unknown): Promise<string> {
    if (typeof newText !== "string") throw new ToolFailure("insert needs the text to insert: `insert_text` (or `new_str`).");
    if (!Number.isInteger(insertLine)) throw new ToolFailure("insert needs `insert_line`, an integer: the line after which to insert (0 inserts at the top).");
    const text = await readTextFile(this.files, path);
    const lines = text ? splitLines(text) : [];
    const at = insertLine as number;
    if (at < 0 || at > lines.length) {
      throw new ToolFailure(`Invalid insert_line ${at}: it must be within [0, ${lines.length}] (the file has ${lines.length} lines; 0 inserts at the top).`);
    }
    const added = newText ? splitLines(newText) : [""];
    const updated = [...lines.slice(0, at), ...added, ...lines.slice(at)].join("\n") + (text.endsWith("\n") || !text ? "\n" : "");
    await writeKeepingMode(this.files, path, updated);
    return `The file ${path} has been edited. Here's the result of running \`cat -n\` on a snippet of the edited file:\n${snippet(updated, at + 1, newText)}\nReview the changes and make sure they are as expected (correct indentation, no duplicate lines). Edit the file again if necessary.`;
  }
}

/** The description of the run_code tool (what persists, what comes back). */
export const RUN_CODE_DESCRIPTION =
  "Run Python in an isolated Linux sandbox and return stdout, stderr and any error. Variables and imports persist " +
  "between calls in the same conversation, so build work up step by step. Use print(...) for anything you want to see; " +
  "the value of the last expression is returned too. A matplotlib chart (plt.show()) comes back as an image. A cell " +
  "that runs past timeout_ms is interrupted and its variables are kept. An exception is a normal result to read and " +
  "fix; reason context_died means the interpreter crashed and earlier variables are gone.";

/** A run_code tool's state: one context of the sandbox, made on first use. */
export class CodeCells {
  private ctx: Promise<CodeContext> | undefined;

  constructor(
    readonly sandbox: Sandbox,
    context?: CodeContext,
    private readonly limits: { stdoutChars?: number; stderrChars?: number } = {},
  ) {
    if (context) this.ctx = Promise.resolve(context);
  }

  /** Runs a cell: JSON text `{stdout, stderr, error, reason, result, images}`. */
  async run(code: unknown, timeoutMs = 60_000): Promise<string> {
    if (typeof code !== "string") throw new ToolFailure("`code` (a string of Python) is required");
    this.ctx ??= this.sandbox.createCodeContext({ language: "python" });
    let ctx: CodeContext;
    try {
      ctx = await this.ctx;
    } catch (e) {
      this.ctx = undefined;
      throw e;
    }
    const ex = await ctx.runCode(code, { timeoutMs });
    const so = this.limits.stdoutChars ?? 8000;
    const se = this.limits.stderrChars ?? 2000;
    return JSON.stringify({
      stdout: ex.stdout.slice(-so),
      stderr: ex.stderr.slice(-se),
      error: ex.error && { name: ex.error.name, value: ex.error.value, traceback: ex.error.traceback.slice(-se) },
      reason: ex.reason,
      result: ex.text,
      images: ex.results.filter((r) => r.png || r.jpeg || r.svg).length,
    });
  }
}

/** A serverless run on `volume` as JSON text for a model: exit code, output and the change list. */
export async function runOnVolume(volume: Volume, command: string, opts: { commit?: CommitMode; timeoutMs?: number } = {}): Promise<string> {
  if (typeof command !== "string" || !command.trim()) throw new ToolFailure("`command` (a shell command line) is required");
  const r = await volume.run(command, { commit: opts.commit ?? "on_success", timeoutMs: opts.timeoutMs });
  return JSON.stringify({
    exit_code: r.exitCode,
    reason: r.reason,
    stdout: capText(r.stdout, 8000),
    stderr: capText(r.stderr, 4000),
    changes: r.changes,
  });
}
