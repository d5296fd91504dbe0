#!/usr/bin/env python3
"""A coding agent in ~60 lines: Claude with Anthropic's bash and text editor tools, every
tool call run in a disposable Locker sandbox.

    pip install -e sdk/python                    # the kit (standard library only)
    export LOCKER_URL=http://127.0.0.1:7070 LOCKER_API_KEY=lk_...   # a running `locker serve`
    export ANTHROPIC_API_KEY=sk-ant-...          # a real model
    python3 examples/python_agent.py "Write fib.py with fib(n), test it, print fib(30)."

Optional: ANTHROPIC_MODEL (default claude-sonnet-4-5), ANTHROPIC_BASE_URL (default
https://api.anthropic.com; the tests point it at a scripted stand-in). It talks to the
Messages API with urllib, so it needs no SDK; with the `anthropic` package, model_call
could as well be `anthropic.Anthropic().messages.create(...)`: run_agent takes its
response objects as they are.
"""

import json
import os
import sys
import urllib.request

from locker import Client, Toolkit, run_agent
from locker.anthropic import BashTool, TextEditorTool

MODEL = os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-5")
BASE = os.environ.get("ANTHROPIC_BASE_URL", "https://api.anthropic.com").rstrip("/")
SYSTEM = (
    "You are working in an isolated Linux machine (Debian, root, python3; no network). "
    "Use the bash tool to run commands and the text editor tool to read and change files. "
    "Work in /root. When you are done, say what you did and the final result in one short paragraph."
)


def model_call(messages, tools):
    body = {"model": MODEL, "max_tokens": 4096, "system": SYSTEM, "messages": messages, "tools": tools}
    req = urllib.request.Request(
        f"{BASE}/v1/messages",
        data=json.dumps(body).encode(),
        headers={
            "x-api-key": os.environ["ANTHROPIC_API_KEY"],
            "anthropic-version": "2023-06-01",
            "content-type": "application/json",
        },
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def show(turn, calls, results):
    for c, r in zip(calls, results):
        arg = c.input.get("command") if isinstance(c.input, dict) else c.input
        first = r.content.splitlines()[0] if r.content else ""
        print(f"[{turn}] {c.name} {str(arg)[:70]!r} -> {'ERROR ' if r.is_error else ''}{first[:70]}", file=sys.stderr)


def main():
    task = " ".join(sys.argv[1:]) or "Write /root/fib.py with a function fib(n), check it with a few asserts, and print fib(30)."
    if not os.environ.get("ANTHROPIC_API_KEY"):
        sys.exit("set ANTHROPIC_API_KEY (and LOCKER_URL, LOCKER_API_KEY for the Locker server)")
    client = Client()  # LOCKER_URL, LOCKER_API_KEY
    with client.sandboxes.create(ttl_s=1800, metadata={"example": "python_agent"}) as sandbox:
        tools = Toolkit([BashTool(sandbox), TextEditorTool(sandbox)], sandbox=sandbox)
        out = run_agent(model_call, tools, task, max_iterations=25, on_turn=show)
        print(out.final_text)
        print(f"({out.stop_reason} after {out.iterations} model calls, {out.tool_calls} tool calls, sandbox {sandbox.id})", file=sys.stderr)
    # leaving the `with` deletes the sandbox


if __name__ == "__main__":
    main()
