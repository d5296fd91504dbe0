"""A small agent loop: call the model, run every tool call of its turn (in parallel), give
all the results back in one turn, until the model stops calling tools or the iteration cap.

    from locker.agent import run_agent

    def model_call(messages, tools):          # any model, any client library
        return anthropic_client.messages.create(model=..., max_tokens=4096,
                                                messages=messages, tools=tools)

    out = run_agent(model_call, toolkit, [{"role": "user", "content": "…"}], max_iterations=20)
    out.stop_reason, out.final_text, out.messages

Tool failures never raise: an exception in a tool, an unknown tool, bad JSON arguments or a
platform error become tool results with is_error, so the model can react. A result longer
than `max_result_chars` keeps its head and tail; the whole text is written to a file in the
sandbox (`/var/tmp/locker/tool-results/<call id>.txt`) whose path is in the text.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .tools import Tool, Toolkit, ToolResult, error_result

__all__ = ["run_agent", "AgentResult", "ToolCall", "truncate_result", "RESULTS_DIR"]

RESULTS_DIR = "/var/tmp/locker/tool-results"


@dataclass
class ToolCall:
    """One tool call of a model turn, whatever the API."""

    id: str
    name: str
    input: Any  # a dict, or a JSON string (OpenAI arguments)
    kind: str = "function"  # function | shell (OpenAI Responses shell_call)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class AgentResult:
    messages: List[Dict[str, Any]]
    iterations: int  # model calls made
    stop_reason: str  # "done" (a turn without tool calls) | "max_iterations"
    final_text: str
    tool_calls: int = 0  # tool calls run in all
    tool_errors: int = 0  # of which returned is_error


def _to_dict(v: Any) -> Dict[str, Any]:
    """A response of an SDK (pydantic model, object with to_dict) or a dict, as a dict."""
    if isinstance(v, Mapping):
        return dict(v)
    for m in ("model_dump", "to_dict", "dict"):
        f = getattr(v, m, None)
        if callable(f):
            try:
                return f(exclude_none=True) if m == "model_dump" else f()
            except TypeError:
                return f()
    raise TypeError(f"the model function returned {type(v).__name__}; return a dict (or an SDK response object)")


# -- one adapter per API: read the turn's tool calls, write the results ---------------------


class _Anthropic:
    api = "anthropic"

    def assistant(self, resp: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], List[ToolCall], str]:
        content = resp.get("content") or []
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        content = [_to_dict(b) for b in content]
        calls = [ToolCall(b["id"], b["name"], b.get("input") or {}, raw=b) for b in content if b.get("type") == "tool_use"]
        text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
        return [{"role": "assistant", "content": content}], calls, text

    def results(self, pairs: Sequence[Tuple[ToolCall, ToolResult]]) -> List[Dict[str, Any]]:
        # All the results of a turn in ONE user message (the API requires it for parallel calls).
        return [{"role": "user", "content": [r.to_anthropic(c.id) for c, r in pairs]}]


class _OpenAIChat:
    api = "openai_chat"

    def assistant(self, resp: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], List[ToolCall], str]:
        if "choices" in resp:
            resp = _to_dict(resp["choices"][0])
            resp = _to_dict(resp["message"])
        msg = {k: v for k, v in resp.items() if k in ("role", "content", "tool_calls", "refusal") and v is not None}
        msg["role"] = "assistant"
        calls = []
        for tc in msg.get("tool_calls") or []:
            tc = _to_dict(tc)
            f = _to_dict(tc.get("function") or {})
            calls.append(ToolCall(tc["id"], f.get("name", ""), f.get("arguments") or "{}", raw=tc))
        if "tool_calls" in msg:
            msg["tool_calls"] = [_to_dict(t) for t in msg["tool_calls"]]
        text = msg.get("content") or ""
        return [msg], calls, text if isinstance(text, str) else ""

    def results(self, pairs: Sequence[Tuple[ToolCall, ToolResult]]) -> List[Dict[str, Any]]:
        # Chat Completions takes one `tool` message per call, all right after the assistant turn.
        out = []
        for c, r in pairs:
            m = r.to_openai_chat(c.id)
            if r.is_error and not m["content"].lower().startswith("error"):
                m["content"] = "Error: " + m["content"]
            out.append(m)
        return out


class _OpenAIResponses:
    api = "openai_responses"

    def assistant(self, resp: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], List[ToolCall], str]:
        items = [_to_dict(i) for i in (resp.get("output") or [])]
        calls, text = [], ""
        for it in items:
            t = it.get("type")
            if t == "function_call":
                calls.append(ToolCall(it["call_id"], it.get("name", ""), it.get("arguments") or "{}", raw=it))
            elif t == "shell_call":
                calls.append(ToolCall(it["call_id"], "shell", _to_dict(it.get("action") or {}), kind="shell", raw=it))
            elif t == "message":
                for c in it.get("content") or []:
                    c = _to_dict(c)
                    if c.get("type") == "output_text":
                        text += c.get("text", "")
        return items, calls, text

    def results(self, pairs: Sequence[Tuple[ToolCall, ToolResult]]) -> List[Dict[str, Any]]:
        out = []
        for c, r in pairs:
            if c.kind == "shell":
                item = getattr(r, "item", None)
                out.append(dict(item, call_id=c.id) if item else {"type": "shell_call_output", "call_id": c.id, "output": [{"stdout": "", "stderr": r.content, "outcome": {"type": "exit", "exit_code": 1}}]})
            else:
                out.append(r.to_openai_responses(c.id))
        return out


_ADAPTERS = {"anthropic": _Anthropic, "openai_chat": _OpenAIChat, "openai_responses": _OpenAIResponses}


def truncate_result(result: ToolResult, call_id: str, max_chars: int, sandbox: Any = None) -> ToolResult:
    """Keeps the head and the tail of a long result; the whole text goes to a file in the
    sandbox whose path is said in the text."""
    text = result.content
    if max_chars <= 0 or len(text) <= max_chars:
        return result
    head_n = max_chars * 2 // 3
    tail_n = max_chars - head_n
    head, tail = text[:head_n], text[len(text) - tail_n :]
    omitted = len(text) - head_n - tail_n
    where = "the full text was not saved (no sandbox)"
    if sandbox is not None:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", call_id)[:100] or "result"
        path = f"{RESULTS_DIR}/{safe}.txt"
        try:
            sandbox.files.write(path, text)
            where = f"the full text ({len(text)} characters) is in {path} in the sandbox: read parts of it with a line range, head, tail or grep"
        except Exception as e:  # noqa: BLE001
            where = f"the full text could not be saved ({e})"
    marker = f"\n…[locker: {omitted} characters omitted; {where}]…\n"
    return ToolResult(head + marker + tail, result.is_error)


def _toolkit(tools: Union[Toolkit, Iterable[Any], Mapping[str, Any]]) -> Toolkit:
    if isinstance(tools, Toolkit):
        return tools
    if isinstance(tools, Mapping):
        tk = Toolkit()
        for name, t in tools.items():
            tk.add(t, name)
        return tk
    return Toolkit(tools)


def run_agent(
    model_call: Callable[[List[Dict[str, Any]], List[Dict[str, Any]]], Any],
    tools: Union[Toolkit, Iterable[Union[Tool, Callable[..., Any]]], Mapping[str, Any]],
    messages: Union[str, List[Dict[str, Any]]],
    max_iterations: int = 20,
    *,
    api: str = "anthropic",
    max_result_chars: int = 20_000,
    sandbox: Any = None,
    max_parallel: int = 8,
    on_turn: Optional[Callable[[int, List[ToolCall], List[ToolResult]], None]] = None,
) -> AgentResult:
    """Runs the loop until the model answers without calling a tool, or `max_iterations`
    model calls were made.

    `model_call(messages, tool_definitions)` calls the model and returns its answer in the
    shape of `api`: "anthropic" (a Messages API response or its dict: `content` blocks with
    `tool_use`), "openai_chat" (a ChatCompletion or its `message`), or "openai_responses"
    (a Response: `output` items with `function_call` / `shell_call`). `messages` (or a
    string: the first user message) is extended in place and returned.

    Every tool call of a turn runs at once in threads (at most `max_parallel`); all of a
    turn's results go back together (Anthropic: one user message of tool_result blocks;
    Chat Completions: one `tool` message per call; Responses: one output item per call).
    """
    if api not in _ADAPTERS:
        raise ValueError(f"unknown api {api!r}: {', '.join(_ADAPTERS)}")
    adapter = _ADAPTERS[api]()
    toolkit = _toolkit(tools)
    sandbox = sandbox if sandbox is not None else toolkit.sandbox
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    definitions = toolkit.definitions(api)
    iterations = calls_n = errors_n = 0
    final_text = ""
    with ThreadPoolExecutor(max_workers=max(1, max_parallel), thread_name_prefix="locker-tool") as pool:
        while iterations < max_iterations:
            iterations += 1
            resp = _to_dict(model_call(messages, definitions))
            turn, calls, text = adapter.assistant(resp)
            messages.extend(turn)
            if text:
                final_text = text
            if not calls:
                return AgentResult(messages, iterations, "done", final_text, calls_n, errors_n)

            def one(c: ToolCall) -> ToolResult:
                try:
                    r = toolkit.call(c.name, c.input)
                except Exception as e:  # noqa: BLE001 (Toolkit.call does not raise; belt and braces)
                    r = error_result(e, c.name)
                if c.kind == "shell":  # structured per-command output; the tool truncates itself
                    return r
                return truncate_result(r, c.id, max_result_chars, sandbox)

            results = list(pool.map(one, calls))
            calls_n += len(calls)
            errors_n += sum(1 for r in results if r.is_error)
            messages.extend(adapter.results(list(zip(calls, results))))
            if on_turn is not None:
                on_turn(iterations, calls, results)
    return AgentResult(messages, iterations, "max_iterations", final_text, calls_n, errors_n)


def tool_input_json(c: ToolCall) -> str:
    return c.input if isinstance(c.input, str) else json.dumps(c.input)
