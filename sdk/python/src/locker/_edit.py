"""File viewing and exact-match editing shared by the Anthropic text editor handler and the
portable `file_edit`/`file_read` function tools. Every function raises ToolFailure with a
message written for the model (what went wrong, what to do next); nothing is changed when
a precondition fails."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .client import Files, LockerError


class ToolFailure(Exception):
    """A tool call that could not be done; the message is the tool result's text."""


def _lines_of(text: str, idx: int) -> int:
    return text.count("\n", 0, idx) + 1


def _show(s: str, limit: int = 200) -> str:
    return s if len(s) <= limit else s[:limit] + f"…[{len(s) - limit} more characters]"


def read_text(files: Files, path: str) -> str:
    try:
        data = files.read(path)
    except LockerError as e:
        if e.status == 404:
            raise ToolFailure(f"The path {path} does not exist. Check the path (list the directory to see what is there).") from e
        if e.status == 400 and "director" in e.message.lower():
            raise ToolFailure(f"The path {path} is a directory, not a file.") from e
        raise
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ToolFailure(f"The file {path} is not UTF-8 text ({len(data)} bytes); it cannot be viewed or edited as text.") from e


def numbered(text: str, start: int = 1) -> str:
    """`cat -n` style: the line number right-aligned in 6 columns, a tab, the line."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, start))


def split_lines(text: str) -> List[str]:
    lines = text.split("\n")
    if len(lines) > 1 and lines[-1] == "":
        lines.pop()
    return lines


def view_range(text: str, path: str, rng: Optional[Sequence[int]]) -> Tuple[str, int]:
    """The lines of `rng` ([start, end], 1-based inclusive, end -1 = to the end) and the
    first line's number."""
    lines = split_lines(text) if text else []
    if rng is None:
        return text, 1
    if not isinstance(rng, (list, tuple)) or len(rng) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in rng):
        raise ToolFailure("view_range must be a list of two integers: [start_line, end_line] (1-based, end_line -1 for the end of the file).")
    start, end = rng
    n = len(lines)
    if start < 1 or start > max(n, 1):
        raise ToolFailure(f"Invalid view_range {list(rng)}: start_line {start} is outside the file's lines [1, {n}].")
    if end == -1:
        end = n
    if end < start:
        raise ToolFailure(f"Invalid view_range {list(rng)}: end_line {end} is before start_line {start} (use -1 for the end of the file).")
    end = min(end, n)
    return "\n".join(lines[start - 1 : end]) + ("\n" if end > start - 1 else ""), start


def str_replace(text: str, path: str, old_str: Optional[str], new_str: Optional[str]) -> Tuple[str, int]:
    """Replaces the one occurrence of old_str; returns the new text and the line where the
    replacement starts."""
    if old_str is None or old_str == "":
        raise ToolFailure("old_str is required and must not be empty: give the exact text to replace, including its whitespace and indentation.")
    count = text.count(old_str)
    if count == 0:
        hint = ""
        stripped = old_str.strip()
        if stripped and stripped in text:
            hint = " The text occurs with different leading/trailing whitespace or indentation: copy it exactly from a fresh view of the file."
        raise ToolFailure(f"No replacement was performed: old_str did not appear verbatim in {path}.{hint} Matching is exact, whitespace included. View the file and copy the text exactly.")
    if count > 1:
        at, lines = 0, []
        while True:
            i = text.find(old_str, at)
            if i < 0:
                break
            lines.append(_lines_of(text, i))
            at = i + 1
        raise ToolFailure(
            f"No replacement was performed: old_str occurs {count} times in {path}, on lines {lines}. "
            "It must occur exactly once: include more surrounding lines to make it unique."
        )
    i = text.index(old_str)
    return text[:i] + (new_str or "") + text[i + len(old_str) :], _lines_of(text, i)


def insert(text: str, path: str, insert_line: object, new_text: Optional[str]) -> str:
    if new_text is None:
        raise ToolFailure("insert needs the text to insert: `insert_text` (or `new_str`).")
    if not isinstance(insert_line, int) or isinstance(insert_line, bool):
        raise ToolFailure("insert needs `insert_line`, an integer: the line after which to insert (0 inserts at the top).")
    lines = split_lines(text) if text else []
    n = len(lines)
    if insert_line < 0 or insert_line > n:
        raise ToolFailure(f"Invalid insert_line {insert_line}: it must be within [0, {n}] (the file has {n} lines; 0 inserts at the top).")
    new_lines = split_lines(new_text) if new_text else [""]
    trailing_nl = text.endswith("\n") or not text
    out = lines[:insert_line] + new_lines + lines[insert_line:]
    return "\n".join(out) + ("\n" if trailing_nl else "")


def snippet(text: str, line: int, new_str: str, around: int = 4) -> Tuple[str, int]:
    """The lines around an edit (numbered), for the model to review."""
    lines = split_lines(text)
    first = max(1, line - around)
    last = min(len(lines), line + new_str.count("\n") + around)
    return numbered("\n".join(lines[first - 1 : last]) + "\n", first), first


def write_keeping_mode(files: Files, path: str, text: str) -> None:
    """Writes an edited file back with the permission bits it had."""
    mode = None
    try:
        mode = format(files.stat(path).mode & 0o7777, "04o")
    except LockerError:
        pass
    files.write(path, text, mode=mode)
