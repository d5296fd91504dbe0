"""The code interpreter: stateful contexts on Jupyter kernels in a sandbox, and a
`run_code` tool for model APIs (Anthropic's Messages, OpenAI's Chat Completions and
Responses) that uses them.

    sb = client.sandboxes.create(template="code-interpreter")
    ctx = sb.create_code_context(language="python")
    ex = ctx.run_code("import pandas as pd\\ndf = pd.DataFrame({'a': [1, 2]})\\ndf")
    ex.stdout, ex.stderr, ex.error, ex.results[0].html
    chart = ctx.run_code("import matplotlib.pyplot as plt\\nplt.plot([1, 2])\\nplt.show()")
    chart.results[0].save_png("chart.png")

Variables and imports persist between calls on one context; `restart()` clears them.
See docs/api.md, "Code contexts (the code interpreter)".
"""

import base64
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional

from .tools import FunctionTool, Toolkit, ToolResult

if TYPE_CHECKING:
    from .client import Sandbox

_MIME_FIELDS = ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "json", "javascript", "chart", "data")


@dataclass
class Result:
    """One output of a cell: the cell's value (`is_main_result`) or something it displayed,
    with a field per MIME type present (`png`, `jpeg`, `pdf` are base64)."""

    is_main_result: bool = False
    text: Optional[str] = None
    html: Optional[str] = None
    markdown: Optional[str] = None
    svg: Optional[str] = None
    png: Optional[str] = None
    jpeg: Optional[str] = None
    pdf: Optional[str] = None
    latex: Optional[str] = None
    json: Any = None
    javascript: Optional[str] = None
    chart: Any = None
    data: Any = None
    truncated: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Result":
        return cls(is_main_result=bool(d.get("is_main_result")), truncated=bool(d.get("truncated")),
                   **{k: d.get(k) for k in _MIME_FIELDS})

    def formats(self) -> List[str]:
        """The MIME fields this result has."""
        return [k for k in _MIME_FIELDS if getattr(self, k) is not None]

    def png_bytes(self) -> bytes:
        if self.png is None:
            raise ValueError("this result has no PNG (its formats: %s)" % ", ".join(self.formats()))
        return base64.b64decode(self.png)

    def save_png(self, path: str) -> str:
        """Writes the PNG to `path` (on this machine) and returns the path."""
        with open(path, "wb") as f:
            f.write(self.png_bytes())
        return path

    def __str__(self) -> str:
        return self.text or ""


@dataclass
class ExecutionError:
    """An exception the code raised (or the kernel's end, or the timeout)."""

    name: str
    value: str
    traceback: str = ""

    def __str__(self) -> str:
        return self.traceback or f"{self.name}: {self.value}"


@dataclass
class Execution:
    """A cell's answer: its output, results, error, and why it ended (`reason`: finished,
    error, timeout, interrupted, context_died)."""

    stdout: str = ""
    stderr: str = ""
    results: List[Result] = field(default_factory=list)
    error: Optional[ExecutionError] = None
    reason: str = "finished"
    execution_count: Optional[int] = None
    context: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timings: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Execution":
        err = d.get("error")
        return cls(
            stdout=d.get("stdout", ""),
            stderr=d.get("stderr", ""),
            results=[Result.from_dict(r) for r in d.get("results", [])],
            error=ExecutionError(err.get("name", ""), err.get("value", ""), err.get("traceback", "")) if err else None,
            reason=d.get("reason", "finished"),
            execution_count=d.get("execution_count"),
            context=d.get("context", ""),
            stdout_truncated=bool(d.get("stdout_truncated")),
            stderr_truncated=bool(d.get("stderr_truncated")),
            timings=dict(d.get("timings") or {}),
        )

    @property
    def text(self) -> Optional[str]:
        """The text of the cell's value, if it had one."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None


def run_code(sandbox: "Sandbox", code: str, context: Optional[str] = None, language: str = "python",
             timeout_ms: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
             on_stdout: Optional[Callable[[str], None]] = None, on_stderr: Optional[Callable[[str], None]] = None,
             on_result: Optional[Callable[[Result], None]] = None, max_output_bytes: Optional[int] = None) -> Execution:
    """Runs one cell (`POST /v1/sandboxes/{id}/code`); with callbacks, output is streamed to
    them as it comes. Without `context`, the sandbox's default context of `language`."""
    body: Dict[str, Any] = {"code": code, "language": language}
    for k, v in (("context", context), ("timeout_ms", timeout_ms), ("env", env), ("max_output_bytes", max_output_bytes)):
        if v is not None:
            body[k] = dict(v) if k == "env" else v
    wait = (timeout_ms or 60_000) / 1000.0 + 180.0
    path = f"/v1/sandboxes/{_seg(sandbox.id)}/code"
    if not (on_stdout or on_stderr or on_result):
        return Execution.from_dict(sandbox._c.request("POST", path, body, timeout=wait))  # noqa: SLF001
    for ev in sandbox._c._ndjson("POST", path, body, timeout=wait):  # noqa: SLF001
        kind = ev.get("type")
        if kind == "stdout" and on_stdout:
            on_stdout(ev.get("text", ""))
        elif kind == "stderr" and on_stderr:
            on_stderr(ev.get("text", ""))
        elif kind == "result" and on_result:
            on_result(Result.from_dict(ev))
        elif kind == "execution":
            return Execution.from_dict(ev)
    raise ConnectionError("the cell's stream ended before its result")


def _seg(s: str) -> str:
    from urllib.parse import quote

    return quote(s, safe="")


class CodeContext:
    """A context: one kernel in the sandbox whose variables persist between `run_code`
    calls. `info` is the Context object the server last answered."""

    def __init__(self, sandbox: "Sandbox", info: Mapping[str, Any]):
        self.sandbox = sandbox
        self.info: Dict[str, Any] = dict(info)
        self.id: str = info["id"]
        self.language: str = info.get("language", "python")

    def __repr__(self) -> str:
        return f"CodeContext({self.id!r}, language={self.language!r})"

    def _path(self, rest: str = "") -> str:
        return f"/v1/sandboxes/{_seg(self.sandbox.id)}/contexts/{_seg(self.id)}{rest}"

    def run_code(self, code: str, **options: Any) -> Execution:
        """Runs a cell here. Options: timeout_ms (default 60000; the kernel is interrupted
        and keeps its state), env (for this cell), max_output_bytes, on_stdout, on_stderr,
        on_result (streaming callbacks)."""
        return run_code(self.sandbox, code, context=self.id, language=self.language, **options)

    def interrupt(self) -> bool:
        """Interrupts the running cell (state kept); whether one was running."""
        return bool(self.sandbox._c.request("POST", self._path("/interrupt"))["interrupted"])  # noqa: SLF001

    def restart(self) -> "CodeContext":
        """A new kernel: variables and imports are cleared."""
        self.info = self.sandbox._c.request("POST", self._path("/restart"), timeout=180.0)  # noqa: SLF001
        return self

    def delete(self) -> None:
        self.sandbox._c.request("DELETE", self._path())  # noqa: SLF001


def create_code_context(sandbox: "Sandbox", language: str = "python", cwd: Optional[str] = None,
                        env: Optional[Mapping[str, str]] = None) -> CodeContext:
    body: Dict[str, Any] = {"language": language}
    if cwd is not None:
        body["cwd"] = cwd
    if env is not None:
        body["env"] = dict(env)
    info = sandbox._c.request("POST", f"/v1/sandboxes/{_seg(sandbox.id)}/contexts", body, timeout=180.0)  # noqa: SLF001
    return CodeContext(sandbox, info)


def code_contexts(sandbox: "Sandbox") -> List[CodeContext]:
    d = sandbox._c.request("GET", f"/v1/sandboxes/{_seg(sandbox.id)}/contexts")  # noqa: SLF001
    return [CodeContext(sandbox, c) for c in d.get("contexts", [])]


RUN_CODE_DESCRIPTION = (
    "Run Python in an isolated Linux sandbox and return stdout, stderr and any error. "
    "Variables and imports persist between calls in the same conversation, so build work up "
    "step by step. Use print(...) for anything you want to see; the value of the last "
    "expression is returned too. numpy, pandas, matplotlib, scipy, requests and pillow are "
    "installed; a matplotlib chart (plt.show()) comes back as an image. A cell that runs past "
    "timeout_ms is interrupted and its variables are kept. The sandbox has no access to "
    "production systems or credentials.\n\n"
    "Returns {stdout, stderr, error (null or {name, value, traceback}), reason (finished | "
    "error | timeout | interrupted | context_died), result (the last expression's text), "
    "images (how many charts were made)}. An exception is a normal result to read and fix, "
    "not a tool failure. context_died means the interpreter crashed: the next call starts a "
    "fresh one and earlier variables are gone."
)


def run_code_tool(sandbox: "Sandbox", context: Optional[CodeContext] = None, name: str = "run_code",
                  timeout_ms: int = 60_000, stdout_chars: int = 8000, stderr_chars: int = 2000,
                  on_image: Optional[Callable[[Result], None]] = None) -> FunctionTool:
    """The seed's `run_code` tool, bound to a context of `sandbox` (made on first call when
    not given). Its definition works for every model API (`tool.definition("anthropic")`,
    "openai_chat", "openai_responses"); output is cut to its last `stdout_chars` and
    `stderr_chars`, as the model re-reads it every turn. `on_image` receives each image."""
    held: Dict[str, CodeContext] = {}
    if context is not None:
        held["ctx"] = context

    def call(args: Mapping[str, Any]) -> ToolResult:
        code = args.get("code")
        if not isinstance(code, str):
            return ToolResult("error: `code` (a string of Python) is required", is_error=True)
        if "ctx" not in held:
            held["ctx"] = sandbox.create_code_context(language="python")
        ex = held["ctx"].run_code(code, timeout_ms=int(args.get("timeout_ms") or timeout_ms))
        images = [r for r in ex.results if r.png or r.jpeg or r.svg]
        if on_image:
            for r in images:
                on_image(r)
        out = {
            "stdout": ex.stdout[-stdout_chars:],
            "stderr": ex.stderr[-stderr_chars:],
            "error": None if ex.error is None else {"name": ex.error.name, "value": ex.error.value,
                                                    "traceback": ex.error.traceback[-stderr_chars:]},
            "reason": ex.reason,
            "result": ex.text,
            "images": len(images),
        }
        return ToolResult(json.dumps(out, ensure_ascii=False))

    return FunctionTool(name, call, RUN_CODE_DESCRIPTION, {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "Python source to run, as in a notebook cell."},
            "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 600_000, "default": timeout_ms,
                           "description": f"Wall-clock limit in milliseconds (default {timeout_ms})."},
        },
        "required": ["code"],
        "additionalProperties": False,
    })


def code_tools(sandbox: "Sandbox", context: Optional[CodeContext] = None) -> Toolkit:
    """A Toolkit with `run_code` bound to `sandbox`: `toolkit.definitions("anthropic")`,
    `"openai_chat"` or `"openai_responses"` for the request, `toolkit.call(name, input)` for
    each call, or `run_agent(..., tools=toolkit)`."""
    return Toolkit([run_code_tool(sandbox, context)], sandbox=sandbox)
