/**
 * Anthropic's door (`locker-sandbox/anthropic`): handlers for the Messages API's client
 * tools run in a Locker sandbox — `bash` (`bash_20250124`) and the text editor
 * (`text_editor_20250728`, tool name `str_replace_based_edit_tool`), plus `run_code` (a
 * custom tool on a code context) — and a plain tool loop over any client with
 * `messages.create` (the `@anthropic-ai/sdk` client, or anything shaped like it):
 *
 *     const tools = new AnthropicTools(sbx);
 *     const out = await runToolLoop({ client: new Anthropic(), model, tools, prompt: "Fix the test" });
 *
 * The loop handles the four failure modes: an iteration cap (`stopReason:
 * "max_iterations"`), errors as `is_error` results (never thrown), every tool call of a turn
 * answered in one user message (run at once, at most `maxParallel`), and results capped
 * (head and tail kept; the whole text saved in the sandbox). Nothing here imports the
 * Anthropic package: the shapes are the Messages API's.
 */

import type { Sandbox } from "./sandbox.js";
import type { CodeContext } from "./code.js";
import { BashSession, CodeCells, RUN_CODE_DESCRIPTION, TextEditor, ToolFailure, asToolOutput, capText, type BashOptions, type EditorOptions, type ToolOutput } from "./tools.js";

/** A `tool_use` content block of the model's answer. */
export interface ToolUseBlock {
  type: "tool_use";
  id: string;
  name: string;
  input: unknown;
}

/** A `tool_result` content block. */
export interface ToolResultBlock {
  type: "tool_result";
  tool_use_id: string;
  content: string;
  is_error?: boolean;
}

/** A `tools` entry of the request. */
export type ToolDefinition = { type: string; name: string; [more: string]: unknown } | { name: string; description: string; input_schema: Record<string, unknown> };

export interface AnthropicToolsOptions {
  bash?: BashOptions;
  editor?: EditorOptions;
  /** Add `run_code` (a context made on first use, or this one). */
  code?: boolean | CodeContext;
}

/** Anthropic's client tools, run in `sandbox`. */
export class AnthropicTools {
  readonly bash: BashSession;
  readonly editor: TextEditor;
  readonly cells: CodeCells | undefined;

  constructor(
    readonly sandbox: Sandbox,
    readonly opts: AnthropicToolsOptions = {},
  ) {
    this.bash = new BashSession(sandbox, opts.bash);
    this.editor = new TextEditor(sandbox.files, opts.editor);
    this.cells = opts.code ? new CodeCells(sandbox, typeof opts.code === "object" ? opts.code : undefined) : undefined;
  }

  /** The request's `tools`. */
  definitions(): ToolDefinition[] {
    const editor: ToolDefinition = { type: "text_editor_20250728", name: "str_replace_based_edit_tool" };
    if (this.opts.editor?.maxCharacters) editor["max_characters"] = this.opts.editor.maxCharacters;
    const defs: ToolDefinition[] = [{ type: "bash_20250124", name: "bash" }, editor];
    if (this.cells) {
      defs.push({
        name: "run_code",
        description: RUN_CODE_DESCRIPTION,
        input_schema: {
          type: "object",
          properties: {
            code: { type: "string", description: "Python source to run, as in a notebook cell." },
            timeout_ms: { type: "integer", minimum: 1, maximum: 600000, description: "Wall-clock limit in milliseconds (default 60000)." },
          },
          required: ["code"],
          additionalProperties: false,
        },
      });
    }
    return defs;
  }

  /** The names this handles. */
  names(): string[] {
    return ["bash", "str_replace_based_edit_tool", ...(this.cells ? ["run_code"] : [])];
  }

  /** Runs one call; never throws (a failure is `isError`). */
  async handle(name: string, input: unknown, opts: { signal?: AbortSignal } = {}): Promise<ToolOutput> {
    return asToolOutput(name, async () => {
      if (!input || typeof input !== "object" || Array.isArray(input)) throw new ToolFailure(`${name}: the input must be a JSON object.`);
      const args = input as Record<string, unknown>;
      if (name === "bash") {
        const unknown = Object.keys(args).filter((k) => k !== "command" && k !== "restart");
        if (unknown.length) throw new ToolFailure(`bash: unknown input key(s) ${JSON.stringify(unknown)}; the valid keys are: command, restart.`);
        if (args["restart"]) return this.bash.restart();
        return this.bash.run(args["command"] as string, opts);
      }
      if (name === "str_replace_based_edit_tool") return this.editor.call(args);
      if (name === "run_code" && this.cells) {
        const t = args["timeout_ms"];
        return this.cells.run(args["code"], typeof t === "number" ? t : undefined);
      }
      throw new ToolFailure(`Unknown tool ${JSON.stringify(name)}: the tools are ${this.names().join(", ")}.`);
    });
  }

  /** A `tool_use` block's `tool_result` block. */
  async call(block: ToolUseBlock, opts: { signal?: AbortSignal } = {}): Promise<ToolResultBlock> {
    const r = await this.handle(block.name, block.input, opts);
    return { type: "tool_result", tool_use_id: block.id, content: r.content, ...(r.isError ? { is_error: true } : {}) };
  }
}

/** What `runToolLoop` needs of a client: the Messages API's `create`. */
export interface MessagesClient {
  messages: { create(params: any, options?: any): Promise<any> };
}

export interface ToolLoopOptions {
  client: MessagesClient;
  model: string;
  tools: AnthropicTools;
  /** The first user message (or give `messages`). */
  prompt?: string;
  messages?: Array<{ role: "user" | "assistant"; content: unknown }>;
  system?: string;
  maxTokens?: number;
  /** Model calls at most (default 20): a model that never stops calling tools stops here. */
  maxIterations?: number;
  /** Tool calls of one turn run at once, at most this many (default 8; 1 runs them in order). */
  maxParallel?: number;
  /** A result past this many characters keeps its head and tail (default 20 000). */
  maxResultChars?: number;
  signal?: AbortSignal;
  /** More request fields (temperature, tool_choice, …). */
  extra?: Record<string, unknown>;
}

export interface ToolLoopResult {
  /** "done": a turn without tool calls; "max_iterations": the cap was reached. */
  stopReason: "done" | "max_iterations";
  finalText: string;
  messages: Array<{ role: "user" | "assistant"; content: unknown }>;
  iterations: number;
  toolCalls: number;
  toolErrors: number;
}

/** Where a capped result's whole text is saved in the sandbox. */
export const TOOL_RESULTS_DIR = "/var/tmp/locker/tool-results";

async function mapLimited<T, R>(items: T[], limit: number, f: (x: T) => Promise<R>): Promise<R[]> {
  const out: R[] = new Array(items.length);
  let next = 0;
  const worker = async () => {
    while (next < items.length) {
      const i = next++;
      out[i] = await f(items[i]!);
    }
  };
  await Promise.all(Array.from({ length: Math.max(1, Math.min(limit, items.length)) }, worker));
  return out;
}

/**
 * The plain tool loop: ask the model, run its tool calls in the sandbox, answer them all
 * in one message, until a turn has no tool call or `maxIterations` model calls were made.
 * Errors of the model call itself are thrown; tool failures never are.
 */
export async function runToolLoop(o: ToolLoopOptions): Promise<ToolLoopResult> {
  const messages = [...(o.messages ?? [])];
  if (o.prompt !== undefined) messages.push({ role: "user", content: o.prompt });
  if (!messages.length) throw new TypeError("runToolLoop needs a `prompt` or `messages`");
  const max = o.maxIterations ?? 20;
  const cap = o.maxResultChars ?? 20_000;
  let toolCalls = 0;
  let toolErrors = 0;
  let finalText = "";
  for (let i = 1; i <= max; i++) {
    const params: Record<string, unknown> = {
      model: o.model,
      max_tokens: o.maxTokens ?? 4096,
      messages,
      tools: o.tools.definitions(),
      ...o.extra,
    };
    if (o.system !== undefined) params["system"] = o.system;
    const res = await o.client.messages.create(params, o.signal ? { signal: o.signal } : undefined);
    const content = (res?.content ?? []) as Array<{ type: string; text?: string; id?: string; name?: string; input?: unknown }>;
    messages.push({ role: "assistant", content });
    finalText = content.filter((b) => b.type === "text").map((b) => b.text ?? "").join("");
    const uses = content.filter((b) => b.type === "tool_use") as ToolUseBlock[];
    if (!uses.length) return { stopReason: "done", finalText, messages, iterations: i, toolCalls, toolErrors };
    const results = await mapLimited(uses, o.maxParallel ?? 8, async (u) => {
      const r = await o.tools.call(u, { signal: o.signal });
      toolCalls++;
      if (r.is_error) toolErrors++;
      if (r.content.length > cap) {
        const where = `${TOOL_RESULTS_DIR}/${u.id.replace(/[^A-Za-z0-9_-]/g, "_")}.txt`;
        const saved = await o.tools.sandbox.files.write(where, r.content).then(() => true, () => false);
        r.content = capText(r.content, cap, saved ? `${where} in the sandbox (read parts of it with sed -n or grep)` : undefined);
      }
      return r;
    });
    messages.push({ role: "user", content: results });
  }
  return { stopReason: "max_iterations", finalText, messages, iterations: max, toolCalls, toolErrors };
}
