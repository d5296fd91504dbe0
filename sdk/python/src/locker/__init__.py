"""Locker for Python: a client of the HTTP API and tool kits for model APIs.

- `Client`: sandboxes, exec, files, background processes, volumes, `run` (serverless).
- `locker.anthropic`: handlers of Anthropic's `bash_20250124` and `text_editor_20250728`.
- `locker.functions`: portable JSON function tools (OpenAI and others) and the OpenAI
  Responses `shell` tool.
- `locker.code`: code contexts (Jupyter kernels; `sandbox.create_code_context()`) and the
  `run_code` tool for every model API.
- `locker.agent.run_agent`: a small agent loop (parallel tool calls, iteration cap,
  errors as results, truncation of large results into a file).
"""

from .client import (
    Changes,
    Client,
    Entry,
    ExecResult,
    Files,
    LockerError,
    McpServer,
    Process,
    ProcessInfo,
    ProcessOutput,
    Sandbox,
    Snapshot,
    StreamEvent,
    Volume,
    VolumeSnapshot,
)
from ._templates import BuildFailed, Templates
from .tools import FunctionTool, Tool, Toolkit, ToolResult
from .code import CodeContext, Execution, ExecutionError, code_tools, run_code_tool
from .agent import AgentResult, run_agent

__version__ = "0.1.0"

__all__ = [
    "Client", "LockerError", "ExecResult", "Changes", "Entry", "StreamEvent", "ProcessOutput",
    "Sandbox", "McpServer", "Volume", "Process", "ProcessInfo", "Files", "Snapshot", "VolumeSnapshot", "Templates", "BuildFailed", "Tool", "FunctionTool", "Toolkit", "ToolResult",
    "run_agent", "AgentResult",
    "CodeContext", "Execution", "ExecutionError", "run_code_tool", "code_tools",
]
