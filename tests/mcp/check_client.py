"""Drives Locker's MCP server with the official Python MCP client (PyPI `mcp`).

Run by tests/mcp.rs against a real `locker serve`:

    python check_client.py http URL KEY MODE      # Streamable HTTP at URL/mcp; MODE: legacy | auto
    python check_client.py stdio LOCKER_BIN URL KEY   # `locker mcp` as a subprocess

Every check raises on failure; the last line printed is a JSON summary.
"""

import asyncio
import json
import sys

from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

TOOLS = {
    "run", "sandbox_create", "exec", "process_output", "process_write_stdin", "process_kill",
    "sandbox_delete", "file_read", "file_write", "file_edit", "file_list", "snapshot_create",
    "sandbox_fork", "volume_create", "volume_list", "sandbox_list", "sandbox_set_ttl", "process_list",
    "snapshot_list", "snapshot_delete", "service_start", "port_list", "run_code",
    "template_build", "template_list",
}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


async def call(c, name, args, expect_error=False):
    r = await c.call_tool(name, args)
    text = "".join(getattr(b, "text", "") for b in r.content)
    if bool(r.is_error) != expect_error:
        raise AssertionError(f"{name}({args}): is_error={r.is_error}, expected {expect_error}: {text}")
    if not expect_error:
        check(r.structured_content is not None, f"{name}: no structuredContent")
        check(json.loads(text) == r.structured_content, f"{name}: the text copy differs from structuredContent")
        return r.structured_content
    return text


async def check_tools(c):
    tools = (await c.list_tools()).tools
    names = {t.name for t in tools}
    check(names == TOOLS, f"tool names: {sorted(names)}")
    for t in tools:
        s = t.input_schema
        check(s.get("type") == "object" and s.get("additionalProperties") is False, f"{t.name}: strict input schema")
        check(t.output_schema and t.output_schema.get("type") == "object", f"{t.name}: output schema")
        a = t.annotations
        check(a is not None, f"{t.name}: annotations")
        for h in ("read_only_hint", "destructive_hint", "idempotent_hint", "open_world_hint"):
            check(getattr(a, h) is not None, f"{t.name}: {h}")
        check(len(t.description or "") > 150, f"{t.name}: description")
    by = {t.name: t for t in tools}
    check(by["run"].input_schema["properties"]["commit"]["enum"] == ["always", "on_success", "never"], "run.commit enum")
    check(by["file_edit"].input_schema["properties"]["command"]["enum"] == ["str_replace", "insert"], "file_edit enum")
    check(by["file_read"].annotations.read_only_hint is True, "file_read is read-only")
    check(by["sandbox_delete"].annotations.destructive_hint is True, "sandbox_delete is destructive")
    check("output_path" in by["exec"].description and "egress" in by["exec"].description, "exec description")
    return len(tools)


async def full_scenario(c):
    summary = {"tools": await check_tools(c)}
    sb = await call(c, "sandbox_create", {"ttl_s": 600})
    sid = sb["id"]
    check(sid.startswith("sb_") and sb["state"] == "running", f"sandbox: {sb}")
    try:
        r = await call(c, "exec", {"sandbox_id": sid, "shell": "echo hi; echo oops >&2; exit 3"})
        check(r["exit_code"] == 3 and r["stdout"] == "hi\n" and r["stderr"] == "oops\n", f"exec: {r}")
        r = await call(c, "exec", {"sandbox_id": sid, "shell": "cd /tmp && export X=1"})
        r = await call(c, "exec", {"sandbox_id": sid, "cmd": ["sh", "-c", "pwd; echo ${X:-unset}"]})
        check(r["stdout"] == "/root\nunset\n", f"cwd and env do not persist: {r}")

        await call(c, "file_write", {"sandbox_id": sid, "path": "/root/app/main.py",
                                     "content": "def f():\n    return 1\n\ndef g():\n    return 1\n"})
        err = await call(c, "file_edit", {"sandbox_id": sid, "path": "/root/app/main.py", "command": "str_replace",
                                          "old_str": "    return 1\n", "new_str": "    return 2\n"}, expect_error=True)
        check("2 times" in err and "lines 2, 5" in err, f"ambiguous old_str: {err}")
        err = await call(c, "file_edit", {"sandbox_id": sid, "path": "/root/app/main.py", "command": "str_replace",
                                          "old_str": "def f():\n  return 1", "new_str": "x"}, expect_error=True)
        check("does not occur" in err, f"whitespace-exact: {err}")
        e = await call(c, "file_edit", {"sandbox_id": sid, "path": "/root/app/main.py", "command": "str_replace",
                                        "old_str": "def g():\n    return 1", "new_str": "def g():\n    return 42"})
        check(e["line"] == 4 and "5\t    return 42" in e["snippet"], f"edit: {e}")
        e = await call(c, "file_edit", {"sandbox_id": sid, "path": "/root/app/main.py", "command": "insert",
                                        "insert_line": 0, "new_str": "import os"})
        check(e["line"] == 1, f"insert: {e}")
        r = await call(c, "file_read", {"sandbox_id": sid, "path": "/root/app/main.py", "start_line": 5, "end_line": 6,
                                        "line_numbers": True})
        check(r["content"] == "5\tdef g():\n6\t    return 42\n" and r["total_lines"] == 6, f"file_read: {r}")
        r = await call(c, "exec", {"sandbox_id": sid, "shell": "cd app && python3 -c 'import main; print(main.g())'"})
        check(r["stdout"] == "42\n", f"edited code runs: {r}")
        ls = await call(c, "file_list", {"sandbox_id": sid, "path": "/root/app"})
        check(any(e["name"] == "main.py" for e in ls["entries"]), f"file_list: {ls}")

        big = await call(c, "exec", {"sandbox_id": sid, "shell": "seq 1 100000", "max_output_bytes": 1024})
        check(big["stdout_truncated"] and big["output_path"] and big["stdout_bytes"] == 588895, f"truncation: {big}")
        r = await call(c, "file_read", {"sandbox_id": sid, "path": big["output_path"], "start_line": 99999})
        check(r["content"] == "99999\n100000\n", f"full output in output_path: {r}")

        p = await call(c, "exec", {"sandbox_id": sid, "shell": "read x; echo got $x", "background": True})
        check(p["process_id"].startswith("proc_"), f"background: {p}")
        await call(c, "process_write_stdin", {"sandbox_id": sid, "process_id": p["process_id"], "data": "hello\n"})
        o = await call(c, "process_output", {"sandbox_id": sid, "process_id": p["process_id"], "wait_ms": 10000})
        check(o["state"] == "exited" and o["stdout"] == "got hello\n" and o["result"]["exit_code"] == 0, f"process_output: {o}")
        p = await call(c, "exec", {"sandbox_id": sid, "shell": "sleep 300", "background": True})
        await call(c, "process_kill", {"sandbox_id": sid, "process_id": p["process_id"], "signal": "SIGKILL"})
        o = await call(c, "process_output", {"sandbox_id": sid, "process_id": p["process_id"], "wait_ms": 10000})
        check(o["state"] == "exited" and o["result"]["exit_code"] is None, f"killed: {o}")

        err = await call(c, "exec", {"sandbox_id": sid, "shell": "true", "bogus": 1}, expect_error=True)
        check("unknown argument `bogus`" in err, err)
    finally:
        d = await call(c, "sandbox_delete", {"sandbox_id": sid})
    check(d == {"sandbox_id": sid, "deleted": True}, f"delete: {d}")
    d = await call(c, "sandbox_delete", {"sandbox_id": sid})
    check(d == {"sandbox_id": sid, "deleted": False}, f"a second delete is not an error: {d}")
    err = await call(c, "exec", {"sandbox_id": sid, "shell": "true"}, expect_error=True)
    check("not_found" in err, f"deleted sandbox: {err}")

    vol = "mcp-test-vol"
    r = await c.call_tool("run", {"volume": vol, "create_volume": True, "size_mb": 64,
                                  "shell": "echo data > out.txt; cat out.txt"})
    text = "".join(getattr(b, "text", "") for b in r.content)
    if r.is_error:
        check("no such route" in text, f"run failed: {text}")
        summary["run"] = "not served"
    else:
        s = r.structured_content
        check(s["exit_code"] == 0 and s["stdout"] == "data\n", f"run: {s}")
        check("/out.txt" in json.dumps(s["changes"]), f"run changes: {s['changes']}")
        f = await call(c, "file_read", {"volume": vol, "path": "/out.txt"})
        check(f["content"] == "data\n", f"volume file: {f}")
        summary["run"] = "ok"
    vols = await call(c, "volume_list", {})
    check(any(v["name"] == vol for v in vols["volumes"]), f"volume_list: {vols}")
    return summary


async def stdio_scenario(c):
    summary = {"tools": await check_tools(c)}
    sb = await call(c, "sandbox_create", {})
    try:
        r = await call(c, "exec", {"sandbox_id": sb["id"], "cmd": ["python3", "-c", "print(6*7)"]})
        check(r["exit_code"] == 0 and r["stdout"] == "42\n", f"exec: {r}")
        await call(c, "file_write", {"sandbox_id": sb["id"], "path": "/root/a.txt", "content": "one\n"})
        await call(c, "file_edit", {"sandbox_id": sb["id"], "path": "/root/a.txt", "command": "insert",
                                    "insert_line": 1, "new_str": "two"})
        r = await call(c, "file_read", {"sandbox_id": sb["id"], "path": "/root/a.txt"})
        check(r["content"] == "one\ntwo\n", f"file_read: {r}")
    finally:
        await call(c, "sandbox_delete", {"sandbox_id": sb["id"]})
    return summary


async def main():
    kind = sys.argv[1]
    if kind == "http":
        url, key, mode = sys.argv[2], sys.argv[3], sys.argv[4]
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {key}"})
        transport = streamable_http_client(url + "/mcp", http_client=http)
        async with Client(transport, mode=mode) as c:
            summary = await full_scenario(c)
            summary["protocol_version"] = c.protocol_version
    else:
        locker_bin, url, key = sys.argv[2], sys.argv[3], sys.argv[4]
        params = StdioServerParameters(command=locker_bin, args=["mcp"],
                                       env={"LOCKER_URL": url, "LOCKER_API_KEY": key})
        async with Client(params, mode="legacy") as c:
            summary = await stdio_scenario(c)
            summary["protocol_version"] = c.protocol_version
    summary["transport"] = kind
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
