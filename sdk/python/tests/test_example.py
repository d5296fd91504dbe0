"""examples/python_agent.py end to end against a stand-in of the Messages API (the real
one is unreachable here): the example's own HTTP calls, tool definitions, parallel tool
calls and results, against a real sandbox."""

import os
import subprocess
import sys

from standin import MessagesStandIn, anthropic_turn, text, tool_use

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "python_agent.py")


def script(body):
    msgs = body["messages"]
    assert {"type": "bash_20250124", "name": "bash"} in body["tools"]
    assert {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"} in body["tools"]
    if len(msgs) == 1:
        return anthropic_turn(
            text("I'll write the file and check python."),
            tool_use("str_replace_based_edit_tool", {"command": "create", "path": "/root/fib.py", "file_text":
                     "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\nassert fib(10) == 55\nprint(fib(30))\n"}),
            tool_use("bash", {"command": "python3 --version"}),
        )
    results = msgs[-1]["content"]
    assert msgs[-1]["role"] == "user" and not any(r.get("is_error") for r in results), results
    if len(msgs) == 3:
        assert len(results) == 2, "both parallel results in one message"
        return anthropic_turn(tool_use("bash", {"command": "cd /root && python3 fib.py"}))
    return anthropic_turn(text(f"fib(30) = {results[0]['content'].strip()}"))


def test_example_agent_against_a_standin_model(client):
    srv = MessagesStandIn(script)
    try:
        env = dict(os.environ, ANTHROPIC_API_KEY=srv.api_key, ANTHROPIC_BASE_URL=srv.url, LOCKER_URL=client.url, LOCKER_API_KEY=client.api_key)
        p = subprocess.run([sys.executable, EXAMPLE], env=env, capture_output=True, text=True, timeout=60)
    finally:
        srv.close()
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "fib(30) = 832040", (p.stdout, p.stderr)
    assert "done after 3 model calls, 3 tool calls" in p.stderr
    assert len(srv.requests) == 3 and srv.requests[0]["body"]["model"]
    sid = p.stderr.rsplit("sandbox ", 1)[1].split(")")[0]
    assert sid not in [s.id for s in client.sandboxes.list()], "the example deletes its sandbox"


def example_env(client, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    env.update(LOCKER_URL=client.url, LOCKER_API_KEY=client.api_key, **extra)
    return env


def test_example_runs_offline_end_to_end_without_a_key(client):
    p = subprocess.run([sys.executable, EXAMPLE, "--offline"], env=example_env(client), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "fib(30) = 832040", (p.stdout, p.stderr)
    assert "done after 3 model calls, 3 tool calls" in p.stderr, p.stderr
    sid = p.stderr.rsplit("sandbox ", 1)[1].split(")")[0]
    assert sid.startswith("sb_") and sid not in [s.id for s in client.sandboxes.list()], "it deletes its sandbox"


def test_example_help_prints_help_and_calls_no_model(client):
    srv = MessagesStandIn(lambda body: anthropic_turn(text("should not be asked")))
    try:
        env = example_env(client, ANTHROPIC_API_KEY=srv.api_key, ANTHROPIC_BASE_URL=srv.url)
        before = len(client.sandboxes.list())
        p = subprocess.run([sys.executable, EXAMPLE, "--help"], env=env, capture_output=True, text=True, timeout=60)
        assert srv.requests == [], "--help is not a task for the model"
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith("usage:") and "--offline" in p.stdout, p.stdout
        assert len(client.sandboxes.list()) == before, "and makes no sandbox"
    finally:
        srv.close()
    p = subprocess.run([sys.executable, EXAMPLE], env=example_env(client), capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--offline" in p.stderr, "without a key it says how to run offline"
