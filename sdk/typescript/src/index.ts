/**
 * Locker's TypeScript client: sandboxes, volumes and serverless runs over the HTTP API,
 * with nothing but the platform's `fetch`.
 *
 *     import { Sandbox } from "locker-sandbox";
 *     await using sbx = await Sandbox.create({ network: { internet: false } });
 *     const r = await sbx.exec(["python3", "-c", "print(1)"], { timeoutMs: 30_000 });
 *
 * This module only re-exports; each concern has its own module.
 */

export { Client } from "./client.js";
export { Sandbox, DEFAULT_WORKDIR, type CreateOptions, type ListFilter, type Connection } from "./sandbox.js";
export { Volume, Volumes, type CommitMode, type RunOptions } from "./volume.js";
export { Secrets, type SecretInfo } from "./secret.js";
export {
  BuildFailed,
  TemplateBuild,
  Templates,
  type BuildContext,
  type BuildEvent,
  type BuildInfo,
  type BuildOptions,
  type ContextFile,
} from "./template.js";
export { Files, type WriteData } from "./files.js";
export { Process, Processes, type Command, type ExecOptions, type ProcessOptions } from "./exec.js";
export {
  CodeContext,
  RESULT_FORMATS,
  type CodeContextInfo,
  type CodeEvent,
  type CodeReason,
  type CodeResult,
  type CreateContextOptions,
  type Execution,
  type ExecutionError,
  type ResultFormat,
  type RunCodeOptions,
} from "./code.js";
export { McpServer, type McpServerInfo, type McpServerOptions } from "./mcp.js";
export { Pty, type PtyOptions, type WebSocketLike } from "./pty.js";
export {
  BashSession,
  CodeCells,
  TextEditor,
  ToolFailure,
  RUN_CODE_DESCRIPTION,
  asToolOutput,
  capText,
  formatExec,
  replaceOnce,
  type BashOptions,
  type EditorOptions,
  type ToolOutput,
} from "./tools.js";
export { SessionSandboxes, SESSION_KEY } from "./sessions.js";
export { DEFAULT_URL, type ClientOptions } from "./transport.js";
export * from "./errors.js";
export type {
  CallRecord,
  Changes,
  Entry,
  ExecResult,
  Network,
  Port,
  ProcessInfo,
  Reason,
  SandboxInfo,
  SandboxState,
  Snapshot,
  StreamEvent,
  TemplateInfo,
  TemplateRunConfig,
  Timings,
  Usage,
  VolumeInfo,
  VolumeMount,
  VolumeSnapshot,
} from "./types.js";
