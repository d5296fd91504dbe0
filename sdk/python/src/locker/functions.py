"""Portable JSON function tools (OpenAI Chat Completions and Responses, Anthropic custom
tools, Gemini, any API that takes a JSON Schema), and OpenAI Responses' `shell` tool.

    from locker.functions import function_tools, ShellTool, dispatch

    tools = function_tools(sandbox=sb, volume="repo")   # exec, process_*, run, file_read, file_write, file_edit, file_list
    defs = [t.definition("openai_chat", strict=True) for t in tools]
    # for each tool call of the answer:
    result = dispatch(tools, call.function.name, call.function.arguments)   # ToolResult

    shell = ShellTool(sb)               # the Responses API's {"type": "shell"} tool
    item = shell.handle(shell_call)     # -> a shell_call_output input item

Every schema sets `additionalProperties: false`; `strict=True` gives OpenAI's strict-mode
variant (every property required, optional ones nullable).
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from . import _edit
from ._edit import ToolFailure
from .client import Client, Files, LockerError, Sandbox, Volume
from .tools import Tool, Toolkit, ToolResult, error_result, function_definition

__all__ = ["function_tools", "background_tools", "dispatch", "LockerFunction", "ShellTool", "ShellResult", "strict_schema"]

BACKGROUND = ("process_start", "process_output", "process_stop")


def network_text(policy: Optional[Mapping[str, Any]]) -> str:
    """What a machine's network policy lets a command do, said for a model; "" when the
    policy is not known (then nothing is promised)."""
    if not isinstance(policy, Mapping):
        return ""
    egress = policy.get("egress")
    if egress == "none":
        return "No network: the machine has no egress at all (no DNS, no downloads); bring inputs with file_write."
    if egress == "all":
        return "Network: the machine can reach the internet (pip install, git clone, curl work)."
    if egress == "allow":
        allow = ", ".join(str(a) for a in policy.get("allow") or []) or "nothing"
        return f"Network: only {allow} (by name or address range); every other destination is refused."
    return ""


def _machine(sandbox: Sandbox) -> str:
    t = sandbox.info.get("template")
    return f"an isolated Linux machine from the template `{t}`; you are root" if t else "an isolated Linux machine; you are root"


def _exec_summary(r) -> Dict[str, Any]:
    d: Dict[str, Any] = {
        "exit_code": r.exit_code,
        "reason": r.reason,
        "stdout": r.stdout,
        "stderr": r.stderr,
    }
    if r.signal:
        d["signal"] = r.signal
    if r.truncated:
        d["stdout_truncated"] = r.stdout_truncated
        d["stderr_truncated"] = r.stderr_truncated
        d["stdout_bytes"] = r.stdout_bytes
        d["stderr_bytes"] = r.stderr_bytes
        d["output_path"] = r.output_path
    if r.changes is not None:
        c = r.changes
        d["changes"] = {"added": c.added, "modified": c.modified, "deleted": c.deleted, "committed": c.committed, "conflicts": c.conflicts}
        if c.commit_error:
            d["changes"]["commit_error"] = c.commit_error
    return d


def strict_schema(schema: Dict[str, Any]) -> Dict[str, Any]:
    """OpenAI strict mode: every property listed in `required`; the optional ones accept
    null (which the handlers treat as absent). Defaults and bounds the mode rejects are
    moved into the descriptions."""
    s = copy.deepcopy(schema)
    req = set(s.get("required", []))
    for name, p in s.get("properties", {}).items():
        for k in ("default", "minimum", "maximum", "minItems", "minLength"):
            if k in p:
                v = p.pop(k)
                if k == "default":
                    p["description"] = (p.get("description", "") + f" Default: {json.dumps(v)}.").strip()
        if name not in req:
            t = p.get("type")
            p["type"] = [t, "null"] if isinstance(t, str) else list(t or []) + ["null"]
            if "enum" in p:
                p["enum"] = list(p["enum"]) + [None]
    s["required"] = list(s.get("properties", {}).keys())
    s["additionalProperties"] = False
    return s


class LockerFunction(Tool):
    """One portable function tool: name, description, JSON Schema, handler."""

    def __init__(self, name: str, description: str, parameters: Dict[str, Any], handler: Callable[[Dict[str, Any]], Any], sandbox: Optional[Sandbox] = None):
        self.name = name
        self.description = description
        self.parameters = parameters
        self.handler = handler
        self.sandbox = sandbox

    def definition(self, api: str = "anthropic", strict: bool = False) -> Dict[str, Any]:
        params = strict_schema(self.parameters) if strict else self.parameters
        return function_definition(self.name, self.description, params, api, strict)

    def __call__(self, input: Mapping[str, Any]) -> ToolResult:  # noqa: A002
        args = {k: v for k, v in input.items() if v is not None}  # strict mode sends nulls
        allowed = set(self.parameters.get("properties", {}))
        unknown = sorted(set(args) - allowed)
        if unknown:
            return ToolResult(f"{self.name}: unknown argument(s) {unknown}; it takes {sorted(allowed)}.", True)
        missing = [k for k in self.parameters.get("required", []) if k not in args]
        if missing:
            return ToolResult(f"{self.name}: missing required argument(s) {missing}.", True)
        try:
            out = self.handler(args)
        except ToolFailure as e:
            return ToolResult(str(e), True)
        except Exception as e:  # noqa: BLE001
            return error_result(e, self.name)
        if isinstance(out, ToolResult):
            return out
        return ToolResult(out if isinstance(out, str) else json.dumps(out, ensure_ascii=False))


def _obj(props: Dict[str, Any], required: Sequence[str]) -> Dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


def _cmd_args(args: Mapping[str, Any]) -> Dict[str, Any]:
    shell, cmd = args.get("shell"), args.get("cmd")
    if (shell is None) == (cmd is None):
        raise ToolFailure("Give exactly one of `shell` (a command line) or `cmd` (an argv array).")
    if cmd is not None and (not isinstance(cmd, list) or not cmd or not all(isinstance(x, str) for x in cmd)):
        raise ToolFailure("`cmd` must be a non-empty array of strings, e.g. [\"python3\", \"main.py\"].")
    return {"shell": shell} if shell is not None else {"cmd": cmd}


def function_tools(
    sandbox: Optional[Sandbox] = None,
    volume: Optional[Union[str, Volume]] = None,
    client: Optional[Client] = None,
    names: Optional[Iterable[str]] = None,
    run_network: Optional[Mapping[str, Any]] = None,
) -> Toolkit:
    """The portable tools, bound to a sandbox (exec, the background tools process_start,
    process_output and process_stop, and the file tools act on it) and/or a volume (run
    uses it; the file tools act on it when there is no sandbox). Without a bound volume,
    `run` takes a `volume` argument. `run_network` is the network policy of every run
    (default none). The descriptions say what the sandbox's network policy allows (as
    `sandbox.info` last saw it). `names` picks a subset. Returns a Toolkit (a collection of
    tools with `definitions(api)` and `call(name, args)`)."""
    if sandbox is None and volume is None and client is None:
        raise ValueError("bind the tools to a sandbox, a volume, or at least a client (for run)")
    client = client or (sandbox._c if sandbox is not None else volume._c if isinstance(volume, Volume) else None)  # noqa: SLF001
    if client is None:
        raise ValueError("give client= when volume is a name")
    vol_name = volume.id if isinstance(volume, Volume) else volume
    files: Optional[Files] = sandbox.files if sandbox is not None else (client.volume(vol_name).files if vol_name else None)
    where = "the sandbox" if sandbox is not None else f"the volume {vol_name} (paths from its root; a run sees it at /workspace)"
    tools: List[LockerFunction] = []

    path_p = {"type": "string", "description": "An absolute path, e.g. /root/app/main.py."}
    timeout_p = lambda d, m: {"type": "integer", "minimum": 1, "maximum": m, "default": d,  # noqa: E731
                              "description": f"Wall-clock limit in milliseconds (default {d}, at most {m}). When it passes, the whole process tree is killed and reason is \"timeout\", with the output so far."}
    shell_p = {"type": "string", "description": "A command line for /bin/sh -c (pipes, &&, globs, redirections work). Give this or cmd."}
    cmd_p = {"type": "array", "items": {"type": "string"}, "description": "argv, run without a shell, e.g. [\"python3\", \"main.py\"]. Give this or shell."}

    if sandbox is not None:
        def do_exec(a: Dict[str, Any]) -> Any:
            r = sandbox.exec(**_cmd_args(a), cwd=a.get("cwd"), stdin=a.get("stdin"), timeout_ms=a.get("timeout_ms", 60_000))
            return _exec_summary(r)

        net = network_text(sandbox.info.get("network"))
        tools.append(LockerFunction(
            "exec",
            f"Run a command in the sandbox ({_machine(sandbox)}) and wait for it. "
            "Use it for anything you would type in a terminal: run tests, inspect the system. Prefer file_read / file_write / "
            "file_edit for files. Each call is a fresh shell: `cd` and `export` do not carry over (pass cwd); files do, "
            "and so do jobs: what a call leaves running (`cmd &`, `nohup`) keeps running after it returns, but what it prints "
            "later is discarded (redirect it to a file); start servers and long jobs with process_start to read their "
            "output. A server left listening is reached by later calls at http://localhost:PORT, and from outside the "
            f"sandbox at {sandbox._c.url}/v1/sandboxes/{sandbox.id}/ports/PORT/ (the API key as a Bearer token). "
            "A timeout kills the whole tree. cwd defaults to /root.\n\n"
            "Returns {exit_code, reason (exited | signaled | timeout | oom | output_limit | killed), stdout, stderr}. A non-zero "
            "exit code is a normal result to read, not a tool error. Output over 65536 bytes per stream keeps its head and tail; "
            "then stdout_truncated is true and the full output is in the file output_path in the sandbox." + (" " + net if net else ""),
            _obj({"shell": shell_p, "cmd": cmd_p,
                  "cwd": {"type": "string", "description": "Working directory, absolute (default /root)."},
                  "stdin": {"type": "string", "description": "Text fed to standard input, then closed."},
                  "timeout_ms": timeout_p(60_000, 300_000)}, []),
            do_exec, sandbox))
        tools.extend(_background(sandbox, shell_p, cmd_p, net))

    def do_run(a: Dict[str, Any]) -> Any:
        v = a.get("volume") or vol_name
        if not v:
            raise ToolFailure("`volume` is required: the name or id of the volume to run on.")
        r = client.run(v, **_cmd_args(a), commit=a.get("commit"), timeout_ms=a.get("timeout_ms"), cwd=a.get("cwd"), network=run_network)
        return _exec_summary(r)

    run_props: Dict[str, Any] = {
        "shell": shell_p, "cmd": cmd_p,
        "commit": {"type": "string", "enum": ["always", "on_success", "never"], "default": "always",
                   "description": "When the command's file changes are applied to the volume: always (whatever the exit status), on_success (only if it exited 0 and no other run changed the same paths meanwhile), never (a dry run)."},
        "cwd": {"type": "string", "description": "Working directory (default /workspace, the volume)."},
        "timeout_ms": timeout_p(60_000, 300_000),
    }
    if not vol_name:
        run_props = {"volume": {"type": "string", "description": "The volume's name or id (vol_…)."}, **run_props}
    tools.append(LockerFunction(
        "run",
        "Run one command in a fresh, disposable machine with "
        + (f"the volume `{vol_name}`" if vol_name else "a volume (persistent files)")
        + " mounted at /workspace (also the working directory); the machine is destroyed afterwards. Use it for a single "
        "command on persistent files (a build, a test run, a script); only files under /workspace survive, not processes or "
        "files elsewhere. The command sees the volume as it was when the run started; when it ends, every path it added, "
        "modified or deleted is listed in `changes` and applied to the volume all at once per `commit`.\n\n"
        "Returns {exit_code, reason, stdout, stderr, changes: {added, modified, deleted, committed, conflicts}}. A non-zero "
        "exit is a result, not a tool error. " + network_text(run_network or {"egress": "none"}),
        _obj(run_props, [] if vol_name else ["volume"]), do_run, sandbox))

    if files is not None:
        def do_read(a: Dict[str, Any]) -> Any:
            text = _edit.read_text(files, a["path"])
            lines = _edit.split_lines(text) if text else []
            start = a.get("start_line", 1)
            end = a.get("end_line", -1)
            part, first = _edit.view_range(text, a["path"], [start, end]) if lines else ("", 1)
            last = first + len(_edit.split_lines(part)) - 1 if part else 0
            return {"path": a["path"], "total_lines": len(lines), "start_line": first, "end_line": last,
                    "content": _edit.numbered(part, first) if part else ""}

        tools.append(LockerFunction(
            "file_read",
            f"Read a UTF-8 text file of {where}, or a range of its lines. Returns {{content, start_line, end_line, "
            "total_lines}; content has each line prefixed by its number and a tab (`    12\\t…`): the numbers are not part of "
            "the file (leave them out of file_edit's old_str). For a long file, read a range (start_line, end_line).",
            _obj({"path": path_p,
                  "start_line": {"type": "integer", "minimum": 1, "default": 1, "description": "First line to return, counting from 1."},
                  "end_line": {"type": "integer", "default": -1, "description": "Last line to return, inclusive; -1 means the end of the file."}},
                 ["path"]),
            do_read, sandbox))

        def do_write(a: Dict[str, Any]) -> Any:
            e = files.write(a["path"], a["content"], mode=a.get("mode"))
            return {"path": e.path, "size": e.size, "written": True}

        tools.append(LockerFunction(
            "file_write",
            f"Create a file of {where}, or replace its whole content (parent directories are created). To change part of an "
            "existing file, use file_edit instead: it is exact and does not rewrite what you did not mean to touch.",
            _obj({"path": path_p, "content": {"type": "string", "description": "The whole new content (UTF-8 text)."},
                  "mode": {"type": "string", "description": "Octal permission bits, e.g. \"0755\" for a script (default 0644)."}},
                 ["path", "content"]),
            do_write, sandbox))

        def do_edit(a: Dict[str, Any]) -> Any:
            path = a["path"]
            text = _edit.read_text(files, path)
            if a["command"] == "str_replace":
                if "insert_line" in a:
                    raise ToolFailure("insert_line is for command insert; str_replace takes old_str and new_str.")
                new_text, line = _edit.str_replace(text, path, a.get("old_str"), a.get("new_str", ""))
                new = a.get("new_str", "")
            else:
                if "old_str" in a:
                    raise ToolFailure("old_str is for command str_replace; insert takes insert_line and new_str.")
                new = a.get("new_str")
                new_text = _edit.insert(text, path, a.get("insert_line"), new)
                line = int(a["insert_line"]) + 1
            _edit.write_keeping_mode(files, path, new_text)
            snip, _ = _edit.snippet(new_text, line, new or "")
            return f"Edited {path}. The lines around the change now read:\n{snip}"

        tools.append(LockerFunction(
            "file_edit",
            f"Edit a text file of {where} in place, exactly.\n"
            "- str_replace: replace old_str by new_str. old_str must occur exactly once in the file, byte for byte: same "
            "spaces, tabs, line breaks and indentation. If it occurs 0 times or several times, nothing is changed and the "
            "error says how many times and on which lines: add surrounding lines to make it unique. An empty new_str deletes.\n"
            "- insert: insert new_str after line insert_line (counting from 1; 0 = at the top).\n"
            "Returns the edited lines with their numbers, to check the result.",
            _obj({"path": path_p,
                  "command": {"type": "string", "enum": ["str_replace", "insert"], "description": "str_replace or insert."},
                  "old_str": {"type": "string", "description": "str_replace only: the exact text to replace (without line numbers)."},
                  "new_str": {"type": "string", "description": "The replacement (str_replace) or the text to insert (insert)."},
                  "insert_line": {"type": "integer", "minimum": 0, "description": "insert only: insert after this line; 0 inserts at the top."}},
                 ["path", "command"]),
            do_edit, sandbox))

        def do_list(a: Dict[str, Any]) -> Any:
            entries = files.list(a.get("path", "/"), depth=a.get("depth", 1))
            return {"entries": [{"path": e.path, "type": e.type, "size": e.size} for e in entries]}

        tools.append(LockerFunction(
            "file_list",
            f"List a directory of {where}: each entry's path, type (file, dir, symlink) and size in bytes. depth 1 lists the "
            "directory itself; 2 also its subdirectories' entries, and so on.",
            _obj({"path": path_p, "depth": {"type": "integer", "minimum": 1, "maximum": 10, "default": 1, "description": "How many levels to list."}},
                 ["path"]),
            do_list, sandbox))

    tk = Toolkit(sandbox=sandbox)
    wanted = set(names) if names is not None else None
    for t in tools:
        if wanted is None or t.name in wanted:
            tk.add(t)
    return tk


def _tail(s: str, n: int) -> str:
    b = s.encode()
    if len(b) <= n:
        return s
    return f"…[first {len(b) - n} bytes omitted]…\n" + b[len(b) - n :].decode("utf-8", "replace")


def _background(sandbox: Sandbox, shell_p: Dict[str, Any], cmd_p: Dict[str, Any], net: str) -> List[LockerFunction]:
    """process_start, process_output, process_stop: a command that outlives the tool call
    (a server, a watcher, a long build), through the sandbox's background processes."""

    def do_start(a: Dict[str, Any]) -> Any:
        p = sandbox.processes.start(**_cmd_args(a), cwd=a.get("cwd"), env=a.get("env"), timeout_ms=a.get("timeout_ms"))
        return {"process_id": p.id, "pid": p.pid, "state": "running"}

    def do_output(a: Dict[str, Any]) -> Any:
        p = sandbox.processes.get(a["process_id"])
        deadline = time.monotonic() + min(int(a.get("wait_ms", 0)), 60_000) / 1000
        while p.describe().running and time.monotonic() < deadline:
            time.sleep(0.1)
        o = p.output()
        cap = int(a.get("max_output_bytes", 30_000))
        d: Dict[str, Any] = {"process_id": p.id, "state": "exited" if o.result is not None else "running",
                             "stdout": _tail(o.stdout, cap), "stderr": _tail(o.stderr, cap)}
        if o.result is not None:
            d["exit_code"], d["reason"] = o.result.exit_code, o.result.reason
            if o.result.signal:
                d["signal"] = o.result.signal
        return d

    def do_stop(a: Dict[str, Any]) -> Any:
        sig = a.get("signal", "SIGTERM")
        sandbox.processes.get(a["process_id"]).signal(sig)
        return {"process_id": a["process_id"], "signal": sig}

    pid_p = {"type": "string", "description": "The id process_start returned (`proc_…`)."}
    return [
        LockerFunction(
            "process_start",
            "Start a command in the background in the sandbox and return at once with its process_id: for servers, watchers "
            "and jobs longer than a call whose output you want (a `cmd &` left by exec keeps running too, but its later "
            "output is discarded). It keeps running "
            "between calls until it exits, process_stop stops it, or the sandbox ends. Read its output with process_output. "
            "timeout_ms, when given, kills it after that many milliseconds." + (" " + net if net else ""),
            _obj({"shell": shell_p, "cmd": cmd_p,
                  "cwd": {"type": "string", "description": "Working directory, absolute (default /root)."},
                  "env": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Extra environment variables."},
                  "timeout_ms": {"type": "integer", "minimum": 1, "description": "Kill it after this many milliseconds."}}, []),
            do_start, sandbox),
        LockerFunction(
            "process_output",
            "What a process started by process_start has printed so far (from its start: reading does not consume it) and "
            "whether it still runs; once it exited, its exit_code and reason. wait_ms waits up to that long (at most 60000) "
            "for it to exit instead of polling. Each stream is cut to its LAST max_output_bytes bytes.",
            _obj({"process_id": pid_p,
                  "wait_ms": {"type": "integer", "minimum": 0, "maximum": 60_000, "default": 0, "description": "Wait up to this many milliseconds for it to exit (0: answer at once)."},
                  "max_output_bytes": {"type": "integer", "minimum": 1024, "maximum": 1_048_576, "default": 30_000, "description": "Keep the last this many bytes of stdout and of stderr."}},
                 ["process_id"]),
            do_output, sandbox),
        LockerFunction(
            "process_stop",
            "Stop a process started by process_start: SIGTERM (default) asks it to stop, SIGKILL stops it at once, SIGINT is "
            "Ctrl-C. Then process_output shows its last output and exit status.",
            _obj({"process_id": pid_p,
                  "signal": {"type": "string", "enum": ["SIGTERM", "SIGKILL", "SIGINT", "SIGHUP"], "default": "SIGTERM", "description": "The signal to send."}},
                 ["process_id"]),
            do_stop, sandbox),
    ]


def background_tools(sandbox: Sandbox) -> Toolkit:
    """Just process_start, process_output and process_stop, e.g. next to Anthropic's bash
    tool (whose commands end with each call)."""
    return function_tools(sandbox=sandbox, names=BACKGROUND)


def dispatch(tools: Union[Toolkit, Iterable[Tool]], name: str, arguments: Union[str, Mapping[str, Any], None]) -> ToolResult:
    """Runs one function call (`arguments`: the JSON string the API sent, or a dict). Never
    raises: unknown tools, bad JSON and failures are ToolResults with is_error."""
    tk = tools if isinstance(tools, Toolkit) else Toolkit(tools)
    return tk.call(name, arguments if arguments is not None else {})


class ShellResult(ToolResult):
    """A shell tool result: `item` is the Responses API `shell_call_output` input item
    (without call_id until handle() adds it); `content` is its output list as JSON."""

    def __init__(self, item: Dict[str, Any]):
        super().__init__(json.dumps(item["output"], ensure_ascii=False), False)
        self.item = item


def _cut(s: str, n: int) -> str:
    if n <= 0 or len(s) <= n:
        return s
    head = n * 2 // 3
    tail = n - head
    return s[:head] + f"\n…[{len(s) - n} characters omitted]…\n" + s[len(s) - tail :]


class ShellTool(Tool):
    """OpenAI Responses' `shell` tool, run in a sandbox: a `shell_call`'s action holds
    `commands` (run in order, each in its own bash, in `cwd`), `timeout_ms` (for all of them
    together) and `max_output_length` (characters of stdout plus stderr kept per command,
    head and tail). The result has one entry per command that ran: stdout, stderr, and
    outcome {"type": "exit", "exit_code": N} or {"type": "timeout"} (the commands after a
    timeout are not run)."""

    name = "shell"

    def __init__(self, sandbox: Sandbox, cwd: str = "/root", default_timeout_ms: int = 120_000, max_timeout_ms: int = 300_000):
        self.sandbox = sandbox
        self.cwd = cwd
        self.default_timeout_ms = default_timeout_ms
        self.max_timeout_ms = max_timeout_ms

    def definition(self, api: str = "openai_responses") -> Dict[str, Any]:
        if api != "openai_responses":
            raise ValueError("the shell tool is an OpenAI Responses tool; elsewhere use exec (locker.functions) or Anthropic's bash")
        return {"type": "shell"}

    def run(self, action: Mapping[str, Any]) -> Dict[str, Any]:
        commands = action.get("commands") or []
        if isinstance(commands, str):
            commands = [commands]
        budget = min(int(action.get("timeout_ms") or self.default_timeout_ms), self.max_timeout_ms)
        limit = action.get("max_output_length")
        deadline = time.monotonic() + budget / 1000
        out: List[Dict[str, Any]] = []
        for cmd in commands:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                out.append({"stdout": "", "stderr": "not run: the time limit was used up by the commands before it", "outcome": {"type": "timeout"}})
                break
            try:
                r = self.sandbox.exec(["bash", "-c", cmd], cwd=self.cwd, timeout_ms=left_ms)
            except LockerError as e:
                out.append({"stdout": "", "stderr": error_result(e).content, "outcome": {"type": "exit", "exit_code": 1}})
                continue
            stdout, stderr = r.stdout, r.stderr
            if r.truncated:
                stderr += f"\n[output truncated; the full output is in {r.output_path} in the sandbox]"
            if limit and len(stdout) + len(stderr) > int(limit):
                n = int(limit)
                e_budget = min(len(stderr), n // 3) if stdout else n
                stdout, stderr = _cut(stdout, n - e_budget), _cut(stderr, e_budget)
            if r.reason == "timeout":
                out.append({"stdout": stdout, "stderr": stderr, "outcome": {"type": "timeout"}})
                break
            code = r.exit_code if r.exit_code is not None else 128 + 9
            out.append({"stdout": stdout, "stderr": stderr, "outcome": {"type": "exit", "exit_code": code}})
        item: Dict[str, Any] = {"type": "shell_call_output", "output": out}
        if limit is not None:
            item["max_output_length"] = limit
        return item

    def __call__(self, input: Mapping[str, Any]) -> ToolResult:  # noqa: A002
        action = input.get("action", input)
        return ShellResult(self.run(action))

    def handle(self, shell_call: Mapping[str, Any]) -> Dict[str, Any]:
        """A `shell_call` output item (dict or SDK object) -> its `shell_call_output` item."""
        from .agent import _to_dict  # noqa: PLC0415

        call = _to_dict(shell_call)
        item = self.run(_to_dict(call.get("action") or {}))
        item["call_id"] = call["call_id"]
        return item
