"""Handlers of Anthropic's client tools, run in a Locker sandbox.

    from locker import Client
    from locker.anthropic import BashTool, TextEditorTool

    sb = Client().sandboxes.create()
    bash, editor = BashTool(sb), TextEditorTool(sb)
    tools = [bash.definition(), editor.definition()]   # -> the Messages API `tools`
    # for each tool_use block of the model's answer:
    result = bash(block["input"])                      # or editor(...): a ToolResult
    result.to_anthropic(block["id"])                   # -> a tool_result content block

- `bash_20250124` (tool name `bash`): each command runs in the sandbox with bash; the
  working directory and exported variables carry over from one command to the next (kept
  in the sandbox under /tmp/.locker-bash/), as in a terminal; shell functions, aliases and
  unexported variables do not. `{"restart": true}` starts afresh. stderr is merged into
  stdout in order. A non-zero exit is reported in the text, not as an error.
- `text_editor_20250728` (tool name `str_replace_based_edit_tool`): `view` (a file with
  line numbers, `view_range`; a directory 2 levels deep), `create`, `str_replace` (old_str
  must occur exactly once, byte for byte), `insert` (after `insert_line`, 0 = top; the
  text in `insert_text` or `new_str`). No `undo_edit` in this version.
"""

from __future__ import annotations

import shlex
import uuid
from typing import Any, Dict, Mapping, Optional, Union

from . import _edit
from ._edit import ToolFailure
from .client import Files, LockerError, Sandbox, Volume
from .tools import Tool, ToolResult, error_result

__all__ = ["BashTool", "TextEditorTool"]


def _unknown_keys(tool: str, input: Mapping[str, Any], valid: tuple) -> Optional[ToolResult]:  # noqa: A002
    """An error naming the valid keys when the input has any other (a setting such as
    `allow_overwrite` belongs to the handler's constructor, not to a call)."""
    unknown = sorted(k for k in input if k not in valid)
    if not unknown:
        return None
    return ToolResult(f"{tool}: unknown input key(s) {unknown}; the valid keys are: {', '.join(valid)}.", True)


def _files_of(target: Union[Sandbox, Volume, Files]) -> Files:
    if isinstance(target, Files):
        return target
    return target.files


class BashTool(Tool):
    """Anthropic's `bash_20250124` tool in a sandbox."""

    name = "bash"
    type = "bash_20250124"

    def __init__(
        self,
        sandbox: Sandbox,
        timeout_ms: int = 120_000,
        max_output_bytes: int = 30_000,
        cwd: str = "/root",
        env: Optional[Mapping[str, str]] = None,
    ):
        self.sandbox = sandbox
        self.timeout_ms = timeout_ms
        self.max_output_bytes = max_output_bytes
        self.cwd = cwd
        self.env = dict(env or {})
        self._new_session()

    def _new_session(self) -> None:
        self.state_dir = f"/tmp/.locker-bash/{uuid.uuid4().hex[:12]}"

    def definition(self, api: str = "anthropic") -> Dict[str, Any]:
        if api != "anthropic":
            raise ValueError("bash_20250124 is an Anthropic tool; for other APIs use locker.functions (exec) or the OpenAI shell tool")
        return {"type": self.type, "name": self.name}

    def _script(self, command: str) -> str:
        d = shlex.quote(self.state_dir)
        return (
            f"__locker_d={d}\n"
            'mkdir -p "$__locker_d"\n'
            '[ -f "$__locker_d/env" ] && . "$__locker_d/env"\n'
            f'cd "$(cat "$__locker_d/cwd" 2>/dev/null || echo {shlex.quote(self.cwd)})" 2>/dev/null || cd {shlex.quote(self.cwd)} 2>/dev/null || cd /\n'
            "__locker_save() {\n"
            "  __locker_rc=$?\n"
            '  pwd > "$__locker_d/cwd"\n'
            "  export -p | grep -v -E '^declare -x (PWD|OLDPWD|SHLVL|_)(=|$)' > \"$__locker_d/env\"\n"
            '  exit "$__locker_rc"\n'
            "}\n"
            "trap __locker_save EXIT\n"
            "exec 2>&1\n"
            f"{command}\n"
        )

    KEYS = ("command", "restart")

    def __call__(self, input: Mapping[str, Any]) -> ToolResult:  # noqa: A002
        bad = _unknown_keys(self.name, input, self.KEYS)
        if bad is not None:
            return bad
        try:
            if input.get("restart"):
                old = self.state_dir
                self._new_session()
                try:
                    self.sandbox.exec(["rm", "-rf", old], timeout_ms=10_000)
                except LockerError:
                    pass
                return ToolResult("tool has been restarted.")
            command = input.get("command")
            if not isinstance(command, str) or not command.strip():
                return ToolResult("no command provided: send {\"command\": \"...\"} (or {\"restart\": true}).", True)
            r = self.sandbox.exec(
                ["bash", "-c", self._script(command)],
                timeout_ms=self.timeout_ms,
                max_output_bytes=self.max_output_bytes,
                env=self.env or None,
            )
        except Exception as e:  # noqa: BLE001
            return error_result(e, "bash")
        return ToolResult(format_exec(r, self.timeout_ms))


def format_exec(r, timeout_ms: Optional[int] = None, merged: bool = True) -> str:
    """An ExecResult as terminal-like text for a model."""
    out = r.stdout
    if not merged and r.stderr:
        out = (out + ("\n" if out and not out.endswith("\n") else "") + r.stderr) if out else r.stderr
    notes = []
    if r.truncated:
        total = r.stdout_bytes + (0 if merged else r.stderr_bytes)
        notes.append(
            f"[output truncated: {total} bytes in all, the middle left out; the full output is in {r.output_path} "
            "in the sandbox: read parts of it with head, tail, sed -n or grep]"
        )
    if r.reason == "timeout":
        t = f" after {timeout_ms / 1000:g} s" if timeout_ms else ""
        notes.append(
            f"[the command timed out{t} and was killed with everything it started (background jobs "
            "too). Split long work into shorter steps that save their progress to files]"
        )
    elif r.reason == "oom":
        notes.append("[the command ran out of memory and was killed]")
    elif r.reason in ("signaled", "killed"):
        notes.append(f"[the command was killed by {r.signal or 'a signal'}]")
    elif r.reason == "output_limit":
        notes.append("[the command was stopped: it produced more output than the sandbox can keep]")
    elif r.exit_code not in (0, None):
        notes.append(f"[exit code: {r.exit_code}]")
    text = out
    if notes:
        text = (text + ("\n" if text and not text.endswith("\n") else "")) + "\n".join(notes)
    return text if text else "(no output)"


class TextEditorTool(Tool):
    """Anthropic's `text_editor_20250728` tool (`str_replace_based_edit_tool`) on a sandbox's
    or a volume's files. `max_characters` caps what `view` returns (also sent to the API in
    the tool definition); `allow_overwrite=False` makes `create` refuse an existing file."""

    name = "str_replace_based_edit_tool"
    type = "text_editor_20250728"

    def __init__(self, target: Union[Sandbox, Volume, Files], max_characters: Optional[int] = None, allow_overwrite: bool = True):
        self.files = _files_of(target)
        self.sandbox = target if isinstance(target, Sandbox) else None
        self.max_characters = max_characters
        self.allow_overwrite = allow_overwrite

    def definition(self, api: str = "anthropic") -> Dict[str, Any]:
        if api != "anthropic":
            raise ValueError("text_editor_20250728 is an Anthropic tool; for other APIs use locker.functions (file_read, file_edit, …)")
        d: Dict[str, Any] = {"type": self.type, "name": self.name}
        if self.max_characters:
            d["max_characters"] = self.max_characters
        return d

    KEYS = ("command", "path", "view_range", "file_text", "old_str", "new_str", "insert_line", "insert_text")

    def __call__(self, input: Mapping[str, Any]) -> ToolResult:  # noqa: A002
        bad = _unknown_keys(self.name, input, self.KEYS)
        if bad is not None:
            return bad
        command = input.get("command")
        path = input.get("path")
        try:
            if command not in ("view", "create", "str_replace", "insert"):
                if command == "undo_edit":
                    raise ToolFailure("undo_edit is not available in this version of the tool. To revert an edit, str_replace the new text back with the old.")
                raise ToolFailure(f"Unknown command {command!r}: use view, create, str_replace or insert.")
            if not isinstance(path, str) or not path:
                raise ToolFailure("`path` is required: an absolute path such as /root/app/main.py.")
            if not path.startswith("/"):
                raise ToolFailure(f"The path {path} is not an absolute path: it should start with `/` (for example /root/{path}).")
            return ToolResult(getattr(self, "_" + command)(path, input))
        except ToolFailure as e:
            return ToolResult(str(e), True)
        except Exception as e:  # noqa: BLE001
            return error_result(e, self.name)

    def _view(self, path: str, input: Mapping[str, Any]) -> str:
        try:
            entry = self.files.stat(path)
        except LockerError as e:
            if e.status == 404:
                raise ToolFailure(f"The path {path} does not exist.") from e
            raise
        if entry.is_dir:
            if input.get("view_range") is not None:
                raise ToolFailure("view_range is for files; the path is a directory.")
            rows = []
            for e in self.files.list(path, depth=2):
                rel = e.path[len(path.rstrip("/")) :].lstrip("/")
                if any(part.startswith(".") for part in rel.split("/")):
                    continue
                rows.append(f"{e.size:>8}  {e.path}{'/' if e.is_dir else ''}")
            return f"Here are the files and directories up to 2 levels deep in {path}, excluding hidden items:\n" + (
                "\n".join(rows) if rows else "(empty)"
            )
        text = _edit.read_text(self.files, path)
        part, first = _edit.view_range(text, path, input.get("view_range"))
        out = _edit.numbered(part, first) if part else ""
        if self.max_characters and len(out) > self.max_characters:
            shown = out[: self.max_characters]
            shown = shown[: shown.rfind("\n") + 1] if "\n" in shown else shown
            last = first + shown.count("\n") - 1
            out = shown + f"[the view was cut at {self.max_characters} characters, after line {last}: view the rest with view_range [{last + 1}, -1]]"
        if not out:
            return f"The file {path} is empty." if not text else f"No lines in that range of {path}."
        return f"Here's the result of running `cat -n` on {path}:\n{out}"

    def _create(self, path: str, input: Mapping[str, Any]) -> str:
        text = input.get("file_text")
        if not isinstance(text, str):
            raise ToolFailure("create needs `file_text`: the whole content of the new file.")
        existed = False
        try:
            e = self.files.stat(path)
            if e.is_dir:
                raise ToolFailure(f"The path {path} is a directory.")
            existed = True
        except LockerError as e:
            if e.status != 404:
                raise
        if existed and not self.allow_overwrite:
            raise ToolFailure(f"File already exists at {path}; create does not overwrite files. Edit it with str_replace or insert.")
        self.files.write(path, text)
        return f"File {'overwritten' if existed else 'created'} successfully at: {path}"

    def _str_replace(self, path: str, input: Mapping[str, Any]) -> str:
        text = _edit.read_text(self.files, path)
        old, new = input.get("old_str"), input.get("new_str")
        if new is not None and not isinstance(new, str):
            raise ToolFailure("new_str must be a string.")
        if old is not None and not isinstance(old, str):
            raise ToolFailure("old_str must be a string.")
        updated, line = _edit.str_replace(text, path, old, new)
        _edit.write_keeping_mode(self.files, path, updated)
        snip, _ = _edit.snippet(updated, line, new or "")
        return (
            f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet of {path}:\n{snip}\n"
            "Review the changes and make sure they are as expected. Edit the file again if necessary."
        )

    def _insert(self, path: str, input: Mapping[str, Any]) -> str:
        text = _edit.read_text(self.files, path)
        new = input.get("insert_text")
        if new is None:
            new = input.get("new_str")
        if new is not None and not isinstance(new, str):
            raise ToolFailure("insert_text must be a string.")
        line = input.get("insert_line")
        updated = _edit.insert(text, path, line, new)
        _edit.write_keeping_mode(self.files, path, updated)
        snip, _ = _edit.snippet(updated, int(line) + 1, new or "")  # type: ignore[arg-type]
        return (
            f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet of the edited file:\n{snip}\n"
            "Review the changes and make sure they are as expected (correct indentation, no duplicate lines). Edit the file again if necessary."
        )
