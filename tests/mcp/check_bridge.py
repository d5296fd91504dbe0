"""Drives MCP servers bridged out of a sandbox (`/v1/sandboxes/{id}/mcp/{name}`) with the
official Python MCP client (PyPI `mcp`). Run by tests/mcp_bridge.rs against a real
`locker serve`:

    python check_bridge.py fs URL KEY MODE        # @modelcontextprotocol/server-filesystem
    python check_bridge.py time URL KEY MODE      # mcp-server-time from PyPI
    python check_bridge.py hostile URL KEY        # tests/mcp/hostile_server.py
    python check_bridge.py deaf URL KEY           # the same, once it stops reading stdin

MODE: legacy (initialize, Mcp-Session-Id) | auto (the current revision, server/discover).
Every check raises on failure; the last line printed is a JSON summary.
"""

import asyncio
import json
import sys
import time

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def client(url, key, mode, handler=None):
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {key}"})
    return Client(streamable_http_client(url, http_client=http), mode=mode, message_handler=handler)


def text_of(r):
    return "".join(getattr(b, "text", "") for b in r.content)


async def error_of(c, name, args=None):
    """The error a tool call ends with (a JSON-RPC error), or fails if it succeeds."""
    try:
        r = await c.call_tool(name, args or {})
    except Exception as e:  # the client raises the JSON-RPC error
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"{name} succeeded: {text_of(r)[:200]}")


async def fs(url, key, mode):
    async with client(url, key, mode) as c:
        names = {t.name for t in (await c.list_tools()).tools}
        check({"read_text_file", "write_file", "list_directory"} <= names, f"filesystem tools: {sorted(names)}")
        r = await c.call_tool("read_text_file", {"path": "/root/data/hello.txt"})
        check(not r.is_error, f"read_text_file: {text_of(r)}")
        read = text_of(r)
        r = await c.call_tool("write_file", {"path": "/root/data/from-mcp.txt", "content": f"written over MCP ({mode})"})
        check(not r.is_error, f"write_file: {text_of(r)}")
        r = await c.call_tool("read_text_file", {"path": "/etc/hostname"})
        check(r.is_error, f"a path outside the allowed directory is refused: {text_of(r)}")
        return {"tools": len(names), "read": read, "protocol_version": c.protocol_version}


async def time_server(url, key, mode):
    async with client(url, key, mode) as c:
        names = {t.name for t in (await c.list_tools()).tools}
        check("get_current_time" in names, f"time tools: {sorted(names)}")
        r = await c.call_tool("get_current_time", {"timezone": "UTC"})
        check(not r.is_error, f"get_current_time: {text_of(r)}")
        now = json.loads(text_of(r))
        return {"tools": len(names), "timezone": now["timezone"], "datetime": now["datetime"],
                "protocol_version": c.protocol_version}


async def hostile(url, key):
    seen = []

    async def handler(message):
        seen.append(type(message).__name__ + ":" + str(getattr(message, "method", "")))

    out = {}
    async with client(url, key, "legacy") as a, client(url, key, "legacy", handler) as b:
        # One process shared by both sessions, initialized once.
        sa = json.loads(text_of(await a.call_tool("stats", {})))
        sb = json.loads(text_of(await b.call_tool("stats", {})))
        check(sa == sb and sa["inits"] == 1, f"one process, one initialize: {sa} {sb}")
        out["pid"] = sa["pid"]
        # Concurrent calls from both sessions each get their own answer.
        rs = await asyncio.gather(*[(a if i % 2 else b).call_tool("stats", {}) for i in range(20)])
        check(all(json.loads(text_of(r))["pid"] == sa["pid"] for r in rs), "concurrent answers")
        # The server's notifications reach the other session's GET stream.
        await a.call_tool("notify", {})
        for _ in range(50):
            if any("ToolListChanged" in s or "tools/list_changed" in s for s in seen):
                break
            await asyncio.sleep(0.1)
        out["notified"] = seen
        # Lines that are not JSON-RPC are dropped; the answer after them arrives.
        r = await a.call_tool("garbage", {})
        check(text_of(r) == "after the garbage", f"garbage: {text_of(r)}")
        # A 100 MB line: an error for that request, then the server still works.
        out["huge"] = await error_of(a, "huge")
        check(json.loads(text_of(await b.call_tool("stats", {})))["inits"] == 1, "works after huge")
        # A request never answered: the bridge's deadline.
        out["never"] = await error_of(b, "never")
        out["after_never"] = json.loads(text_of(await b.call_tool("stats", {})))["pid"]
    # Stdout closed while the process lives, then the process exits. The session cannot end
    # cleanly afterwards (the server is gone): its teardown errors are recorded, not raised.
    c = client(url, key, "legacy")
    await c.__aenter__()
    await c.list_tools()  # the client validates results against them: list before stdout closes
    r = await c.call_tool("close_stdout", {})
    check(text_of(r) == "closing stdout", f"close_stdout: {text_of(r)}")
    out["closed_stdout"] = await error_of(c, "stats")
    out["exit"] = await error_of(c, "exit")
    try:
        await c.__aexit__(None, None, None)
    except BaseException as e:
        out["teardown"] = repr(e)[:300]
    return out


async def deaf(url, key):
    """A server that stops reading its stdin: requests still end at their deadline, even
    once the pipe to it is full."""
    out = {}
    async with client(url, key, "legacy") as c:
        await c.list_tools()
        out["deaf"] = await error_of(c, "deaf")
        started = time.monotonic()
        out["blocked"] = await error_of(c, "stats", {"pad": "x" * (4 << 20)})
        out["blocked_s"] = time.monotonic() - started
    return out


async def main():
    what, url, key = sys.argv[1], sys.argv[2], sys.argv[3]
    if what == "fs":
        summary = await fs(url, key, sys.argv[4])
    elif what == "time":
        summary = await time_server(url, key, sys.argv[4])
    elif what == "hostile":
        summary = await hostile(url, key)
    elif what == "deaf":
        summary = await deaf(url, key)
    else:
        raise SystemExit(f"unknown scenario {what}")
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
