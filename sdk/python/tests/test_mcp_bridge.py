"""MCP servers inside a sandbox through the SDK: `sandbox.mcp_server(...)` starts a stdio
server in the machine and hands back what an MCP client needs (url, headers); the server
answers Streamable HTTP there; `stop()` ends it. The kits tell a model how to reach ports."""

import json
import urllib.error
import urllib.request

import pytest

from locker import LockerError, McpServer
from locker.functions import function_tools

ECHO = r'''
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if "id" not in m:
        continue
    if m["method"] == "initialize":
        r = {"protocolVersion": m["params"]["protocolVersion"], "capabilities": {"tools": {}},
             "serverInfo": {"name": "echo", "version": "1"}}
    elif m["method"] == "tools/list":
        r = {"tools": [{"name": "echo", "inputSchema": {"type": "object"}}]}
    elif m["method"] == "tools/call":
        r = {"content": [{"type": "text", "text": m["params"]["arguments"]["text"]}]}
    else:
        r = {}
    print(json.dumps({"jsonrpc": "2.0", "id": m["id"], "result": r}), flush=True)
'''


def post(server, body, session=None):
    headers = dict(server.headers, **{"Content-Type": "application/json",
                                      "Accept": "application/json, text/event-stream"})
    if session:
        headers["Mcp-Session-Id"] = session
    req = urllib.request.Request(server.url, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read().decode()
        sid = r.headers.get("mcp-session-id")
    # An SSE answer carries the message in a `data:` line.
    data = [l[5:].strip() for l in raw.splitlines() if l.startswith("data:") and l[5:].strip()]
    return json.loads(data[-1] if data else raw), sid


def test_an_mcp_server_in_a_sandbox_is_reached_with_its_url_and_headers(sandbox):
    sandbox.files.write("/root/echo.py", ECHO)
    with sandbox.mcp_server("echo", ["python3", "/root/echo.py"], env={"X": "1"}, cwd="/root") as srv:
        assert isinstance(srv, McpServer) and srv.state == "running", srv.info
        assert srv.url.endswith(f"/v1/sandboxes/{sandbox.id}/mcp/echo")
        assert srv.headers["Authorization"].startswith("Bearer ")
        init, sid = post(srv, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "sdk-test", "version": "1"}}})
        assert init["result"]["serverInfo"]["name"] == "echo", init
        assert sid, "a session id"
        out, _ = post(srv, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                            "params": {"name": "echo", "arguments": {"text": "hi over MCP"}}}, sid)
        assert out["result"]["content"][0]["text"] == "hi over MCP", out
        assert [s.name for s in sandbox.mcp_servers()] == ["echo"]
        with pytest.raises(LockerError) as e:
            sandbox.mcp_server("echo", ["python3", "/root/echo.py"])
        assert e.value.status == 409
    assert sandbox.mcp_servers() == []
    with pytest.raises(urllib.error.HTTPError) as e:
        post(srv, {"jsonrpc": "2.0", "id": 3, "method": "ping"})
    assert e.value.code == 404


def test_bad_mcp_servers_are_refused_with_what_to_fix(sandbox):
    with pytest.raises(LockerError) as e:
        sandbox.mcp_server("Not OK", ["python3"])
    assert e.value.status == 400 and "a-z" in str(e.value)
    with pytest.raises(LockerError) as e:
        sandbox.mcp_server("quits", ["sh", "-c", "echo gone >&2; exit 4"])
    assert e.value.status == 502 and "exit code 4" in str(e.value) and "gone" in str(e.value)


def test_the_exec_tool_says_how_to_reach_a_port_left_listening(sandbox):
    d = function_tools(sandbox=sandbox).tools["exec"].description
    assert "http://localhost:PORT" in d and f"/v1/sandboxes/{sandbox.id}/ports/PORT/" in d, d
