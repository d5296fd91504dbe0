"""What every tool handler returns, and a set of tools the agent loop dispatches to."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Union


@dataclass
class ToolResult:
    """A tool call's result as the model sees it: the text, and whether it is an error.

    `is_error` is for calls that could not be done (bad arguments, a platform failure, an
    edit whose precondition failed); a command that exits non-zero is not an error."""

    content: str
    is_error: bool = False

    def to_anthropic(self, tool_use_id: str) -> Dict[str, Any]:
        """A `tool_result` content block of the Messages API."""
        block: Dict[str, Any] = {"type": "tool_result", "tool_use_id": tool_use_id, "content": self.content}
        if self.is_error:
            block["is_error"] = True
        return block

    def to_openai_chat(self, tool_call_id: str) -> Dict[str, Any]:
        """A `tool` message of Chat Completions (an error is said in the text)."""
        return {"role": "tool", "tool_call_id": tool_call_id, "content": self.content}

    def to_openai_responses(self, call_id: str) -> Dict[str, Any]:
        """A `function_call_output` input item of the Responses API."""
        return {"type": "function_call_output", "call_id": call_id, "output": self.content}


class Tool:
    """A tool the agent loop can call: a name, its definitions for the model APIs, and
    `__call__(input: dict) -> ToolResult`."""

    name: str = ""

    def definition(self, api: str = "anthropic") -> Dict[str, Any]:
        raise NotImplementedError

    def __call__(self, input: Mapping[str, Any]) -> ToolResult:  # noqa: A002
        raise NotImplementedError


class FunctionTool(Tool):
    """A plain function as a tool: `fn(input) -> ToolResult | str | JSON-able`."""

    def __init__(self, name: str, fn: Callable[[Mapping[str, Any]], Any], description: str = "", parameters: Optional[Dict[str, Any]] = None):
        self.name = name
        self.fn = fn
        self.description = description
        self.parameters = parameters or {"type": "object", "properties": {}, "additionalProperties": False}

    def definition(self, api: str = "anthropic") -> Dict[str, Any]:
        return function_definition(self.name, self.description, self.parameters, api)

    def __call__(self, input: Mapping[str, Any]) -> ToolResult:  # noqa: A002
        return as_result(self.fn(input))


def as_result(v: Any) -> ToolResult:
    if isinstance(v, ToolResult):
        return v
    if isinstance(v, str):
        return ToolResult(v)
    return ToolResult(json.dumps(v, ensure_ascii=False, default=str))


def function_definition(name: str, description: str, parameters: Dict[str, Any], api: str = "anthropic", strict: bool = False) -> Dict[str, Any]:
    """One function tool's definition in the shape `api` wants: "anthropic" (Messages
    `tools`), "openai_chat" (Chat Completions `tools`), "openai_responses" (Responses
    `tools`), or "json" (the bare {name, description, parameters})."""
    if api == "anthropic":
        return {"name": name, "description": description, "input_schema": parameters}
    if api == "openai_chat":
        f: Dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
        if strict:
            f["strict"] = True
        return {"type": "function", "function": f}
    if api == "openai_responses":
        d: Dict[str, Any] = {"type": "function", "name": name, "description": description, "parameters": parameters}
        if strict:
            d["strict"] = True
        return d
    if api == "json":
        return {"name": name, "description": description, "parameters": parameters}
    raise ValueError(f"unknown api {api!r}: anthropic, openai_chat, openai_responses or json")


class Toolkit:
    """Tools by name, for the agent loop: `toolkit.definitions("anthropic")` goes into the
    model request, `toolkit.call(name, input)` runs one call and never raises.

    `sandbox` (optional) is where the agent loop leaves the full text of a tool result it
    truncates."""

    def __init__(self, tools: Iterable[Union[Tool, Callable[..., Any]]] = (), sandbox: Any = None):
        self.tools: Dict[str, Tool] = {}
        self.sandbox = sandbox
        for t in tools:
            self.add(t)

    def add(self, tool: Union[Tool, Callable[..., Any]], name: Optional[str] = None) -> "Toolkit":
        if not isinstance(tool, Tool):
            tool = FunctionTool(name or getattr(tool, "__name__", "tool"), tool, (getattr(tool, "__doc__", None) or "").strip())
        self.tools[name or tool.name] = tool
        if self.sandbox is None and getattr(tool, "sandbox", None) is not None:
            self.sandbox = tool.sandbox  # type: ignore[attr-defined]
        return self

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def __iter__(self):
        return iter(self.tools.values())

    def definitions(self, api: str = "anthropic") -> List[Dict[str, Any]]:
        return [t.definition(api) for t in self.tools.values()]

    def call(self, name: str, input: Any) -> ToolResult:  # noqa: A002
        """Runs one tool call; every failure is a ToolResult with is_error (never raises)."""
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(f"Unknown tool {name!r}. The tools are: {', '.join(sorted(self.tools))}.", True)
        if isinstance(input, str):
            try:
                input = json.loads(input) if input.strip() else {}
            except ValueError as e:
                return ToolResult(f"The arguments of {name} are not valid JSON ({e}); send a JSON object.", True)
        if not isinstance(input, Mapping):
            return ToolResult(f"The arguments of {name} must be a JSON object, not {type(input).__name__}.", True)
        try:
            return as_result(tool(input))
        except Exception as e:  # a tool failure is a result the model can act on
            return error_result(e, name)


def error_result(e: BaseException, name: str = "") -> ToolResult:
    from .client import LockerError  # noqa: PLC0415

    if isinstance(e, LockerError):
        what = f"Locker could not do it ({e.code}, HTTP {e.status}): {e.message}" if e.status else f"Locker is unreachable: {e.message}"
        return ToolResult(f"{name}: {what}" if name else what, True)
    return ToolResult(f"{name} failed: {type(e).__name__}: {e}" if name else f"{type(e).__name__}: {e}", True)
