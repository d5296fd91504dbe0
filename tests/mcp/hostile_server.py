"""A deliberately misbehaving stdio MCP server, run inside a sandbox by tests/mcp_bridge.rs.

It answers `initialize`, `ping` and `tools/list` properly; each tool misbehaves in one way:
    stats         answers {"inits": N, "pid": P}: how often it was initialized (the bridge
                  shares one process between sessions, so N stays 1)
    garbage       writes lines that are not JSON-RPC, then answers
    huge          answers with one 100 MB line
    never         never answers
    close_stdout  answers, then closes its stdout and keeps running (answers go nowhere)
    exit          exits at once with code 7
    notify        answers, then sends notifications/tools/list_changed
    deaf          never answers and stops reading its stdin (the pipe fills up)
"""

import json
import os
import sys
import time

TOOLS = ["stats", "garbage", "huge", "never", "close_stdout", "exit", "notify", "deaf"]
inits = 0


def send(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def ok(mid, text):
    send({"jsonrpc": "2.0", "id": mid, "result": {"content": [{"type": "text", "text": text}]}})


for line in sys.stdin:
    msg = json.loads(line)
    mid, method = msg.get("id"), msg.get("method")
    if mid is None:
        continue
    if method == "initialize":
        inits += 1
        send({"jsonrpc": "2.0", "id": mid, "result": {
            "protocolVersion": msg["params"]["protocolVersion"],
            "capabilities": {"tools": {"listChanged": True}},
            "serverInfo": {"name": "hostile", "version": "1.0"}}})
    elif method == "ping":
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": [
            {"name": n, "description": n, "inputSchema": {"type": "object"}} for n in TOOLS]}})
    elif method == "tools/call":
        name = msg["params"]["name"]
        if name == "stats":
            ok(mid, json.dumps({"inits": inits, "pid": os.getpid()}))
        elif name == "garbage":
            sys.stdout.write("this is not JSON\n{\"half\": \n[1, 2, 3]\n\n")
            ok(mid, "after the garbage")
        elif name == "huge":
            sys.stdout.write('{"jsonrpc": "2.0", "id": %d, "result": {"content": [{"type": "text", "text": "' % mid)
            chunk = "x" * (1 << 20)
            for _ in range(100):
                sys.stdout.write(chunk)
            sys.stdout.write('"}]}}\n')
            sys.stdout.flush()
        elif name == "never":
            pass
        elif name == "close_stdout":
            ok(mid, "closing stdout")
            os.close(1)
            sys.stdout = open(os.devnull, "w")  # it keeps reading stdin; its answers go nowhere
        elif name == "exit":
            sys.stderr.write("hostile: exiting on purpose\n")
            sys.stderr.flush()
            os._exit(7)
        elif name == "deaf":
            time.sleep(3600)
        elif name == "notify":
            ok(mid, "notifying")
            send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
    else:
        send({"jsonrpc": "2.0", "id": mid, "error": {"code": -32601, "message": "no " + method}})
