#!/usr/bin/env python3
"""A coding agent in ~100 lines: Claude with Anthropic's bash and text editor tools (and
Locker's background-process tools), every tool call run in a disposable Locker sandbox.

    pip install ./sdk/python                     # the kit, `locker-sandbox` (standard library only)
    export LOCKER_URL=http://127.0.0.1:7070 LOCKER_API_KEY=lk_...   # a running `locker serve`
    export ANTHROPIC_API_KEY=sk-ant-...          # a real model
    python3 examples/python_agent.py "Write fib.py with fib(n), test it, print fib(30)."
    python3 examples/python_agent.py --offline   # no model, no key: a scripted stand-in

Optional: ANTHROPIC_MODEL (default claude-sonnet-4-5), ANTHROPIC_BASE_URL (default
https://api.anthropic.com). It talks to the Messages API with urllib, so it needs no SDK;
with the `anthropic` package, model_call could as well be
`anthropic.Anthropic().messages.create(...)`: run_agent takes its response objects as they
are. `--offline` answers with `locker.testing.MessagesStandIn`, a local stand-in of the
Messages API playing a fixed script (write fib.py, run it, report), so the whole loop
(requests, tool calls, the sandbox) runs for real without a model.
"""

import argparse
import json
import os
import sys
import urllib.request

from locker import Client, Toolkit, run_agent
from locker.anthropic import BashTool, TextEditorTool
from locker.functions import background_tools, network_text

MODEL = os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-5")
DEFAULT_TASK = "Write /root/fib.py with a function fib(n), check it with a few asserts, and print fib(30)."


def system_prompt(sandbox):
    net = network_text(sandbox.network) or "Network: unknown."
    return (
        f"You are working in an isolated Linux machine (root; template {sandbox.info.get('template', 'default')}). {net} "
        "Use the bash tool to run commands and the text editor tool to read and change files; "
        "process_start for servers and long jobs (bash commands end with each call). "
        "Work in /root. When you are done, say what you did and the final result in one short paragraph."
    )


def model_caller(base, api_key, system):
    def model_call(messages, tools):
        body = {"model": MODEL, "max_tokens": 4096, "system": system, "messages": messages, "tools": tools}
        req = urllib.request.Request(
            f"{base}/v1/messages",
            data=json.dumps(body).encode(),
            headers={"x-api-key": api_key, "anthropic-version": "2023-06-01", "content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.load(r)

    return model_call


def offline_script(body):
    """The stand-in model's turns: write fib.py and check python in parallel, run it, report."""
    from locker.testing import anthropic_turn, text, tool_use  # noqa: PLC0415

    msgs = body["messages"]
    if len(msgs) == 1:
        code = "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\nassert fib(10) == 55\nprint(fib(30))\n"
        return anthropic_turn(
            text("I'll write the file and check python."),
            tool_use("str_replace_based_edit_tool", {"command": "create", "path": "/root/fib.py", "file_text": code}),
            tool_use("bash", {"command": "python3 --version"}),
        )
    if len(msgs) == 3:
        return anthropic_turn(tool_use("bash", {"command": "cd /root && python3 fib.py"}))
    return anthropic_turn(text(f"fib(30) = {msgs[-1]['content'][0]['content'].strip()}"))


def show(turn, calls, results):
    for c, r in zip(calls, results):
        arg = c.input.get("command") if isinstance(c.input, dict) else c.input
        first = r.content.splitlines()[0] if r.content else ""
        print(f"[{turn}] {c.name} {str(arg)[:70]!r} -> {'ERROR ' if r.is_error else ''}{first[:70]}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(
        description="A coding agent (Claude + bash + text editor) whose tool calls run in a disposable Locker sandbox.",
        epilog="Needs LOCKER_URL and LOCKER_API_KEY (a running `locker serve`), and ANTHROPIC_API_KEY unless --offline.",
    )
    ap.add_argument("task", nargs="*", help=f"what to do (default: {DEFAULT_TASK!r})")
    ap.add_argument("--offline", action="store_true", help="no model and no key: a local stand-in of the Messages API plays a fixed script")
    ap.add_argument("--max-iterations", type=int, default=25, help="model calls at most (default 25)")
    args = ap.parse_args()
    task = " ".join(args.task) or DEFAULT_TASK

    standin = None
    if args.offline:
        from locker.testing import MessagesStandIn  # noqa: PLC0415

        standin = MessagesStandIn(offline_script)
        base, key = standin.url, standin.api_key
    else:
        key = os.environ.get("ANTHROPIC_API_KEY")
        if not key:
            sys.exit("set ANTHROPIC_API_KEY (and LOCKER_URL, LOCKER_API_KEY for the Locker server), or run with --offline")
        base = os.environ.get("ANTHROPIC_BASE_URL", "https://api.anthropic.com").rstrip("/")
    try:
        client = Client()  # LOCKER_URL, LOCKER_API_KEY
        with client.sandboxes.create(ttl_s=1800, metadata={"example": "python_agent"}) as sandbox:
            tools = Toolkit([BashTool(sandbox), TextEditorTool(sandbox), *background_tools(sandbox)], sandbox=sandbox)
            out = run_agent(model_caller(base, key, system_prompt(sandbox)), tools, task, max_iterations=args.max_iterations, on_turn=show)
            print(out.final_text)
            print(f"({out.stop_reason} after {out.iterations} model calls, {out.tool_calls} tool calls, sandbox {sandbox.id})", file=sys.stderr)
        # leaving the `with` deletes the sandbox
    finally:
        if standin is not None:
            standin.close()


if __name__ == "__main__":
    main()
