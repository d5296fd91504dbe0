"""The code interpreter through the SDK, against a real `locker serve` whose host has the
`code-interpreter` template: contexts, Execution, save_png, and the seed's run_code tool
loop with a scripted stand-in for the model (Anthropic and OpenAI shapes).

Needs LOCKER_URL, LOCKER_API_KEY and LOCKER_CODE_TEMPLATE=1 (tests/code.rs sets them after
building the template); skipped otherwise, so the SDK's own suite does not need the
template. Runs under pytest or as `python3 test_code.py` (the standard library only).
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from locker import Client, LockerError, code_tools, run_agent  # noqa: E402
from locker.testing import Scripted, anthropic_turn, text, tool_use  # noqa: E402


def _client():
    if not (os.environ.get("LOCKER_URL") and os.environ.get("LOCKER_API_KEY") and os.environ.get("LOCKER_CODE_TEMPLATE")):
        try:
            import pytest
        except ImportError:
            raise SystemExit("set LOCKER_URL, LOCKER_API_KEY and LOCKER_CODE_TEMPLATE=1")
        pytest.skip("LOCKER_CODE_TEMPLATE=1 and a server are needed (tests/code.rs runs these)")
    return Client(os.environ["LOCKER_URL"], os.environ["LOCKER_API_KEY"])


def test_a_context_keeps_state_and_a_chart_saves_as_png():
    c = _client()
    with c.sandboxes.create(template="code-interpreter", ttl_s=600) as sb:
        ctx = sb.create_code_context(language="python")
        assert ctx.id.startswith("ctx_")
        ex = ctx.run_code("import math\nx = math.factorial(5)\nprint('x is', x)")
        assert ex.stdout == "x is 120\n" and ex.error is None and ex.reason == "finished", ex
        ex = ctx.run_code("x + 1")
        assert ex.text == "121", ex
        chart = ctx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.show()")
        png = [r for r in chart.results if r.png]
        assert len(png) == 1, chart
        with tempfile.TemporaryDirectory() as d:
            path = png[0].save_png(os.path.join(d, "chart.png"))
            with open(path, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        bad = ctx.run_code("undefined_name")
        assert bad.error is not None and bad.error.name == "NameError" and bad.reason == "error", bad
        assert "undefined_name" in bad.error.traceback
        streamed = []
        ex = ctx.run_code("print('a', flush=True)\nprint('b')", on_stdout=streamed.append)
        assert "".join(streamed) == "a\nb\n" and ex.stdout == "a\nb\n", (streamed, ex)
        assert ctx.interrupt() is False
        ctx.restart()
        assert ctx.run_code("'x' in globals()").text == "False"
        assert [k.id for k in sb.code_contexts()] == [ctx.id]
        ctx.delete()
        try:
            ctx.run_code("1")
            raise AssertionError("a deleted context answered")
        except LockerError as e:
            assert e.status == 404, e


def test_the_seeds_run_code_tool_loop_with_a_scripted_model():
    c = _client()
    with c.sandboxes.create(template="code-interpreter", ttl_s=600) as sb:
        tools = code_tools(sb)
        d = tools.definitions("anthropic")[0]
        assert d["name"] == "run_code" and "persist" in d["description"] and d["input_schema"]["required"] == ["code"]
        assert tools.definitions("openai_chat")[0]["function"]["name"] == "run_code"

        def result_of(messages, i=-1):
            block = messages[-1]["content"][i]
            assert block["type"] == "tool_result", block
            return block, json.loads(block["content"])

        def second(messages):
            _, r = result_of(messages)
            assert r["stdout"] == "loaded 3 rows\n" and r["error"] is None, r
            return anthropic_turn(tool_use("run_code", {"code": "print(df['v'].sum())\n1 / 0"}))

        def third(messages):
            block, r = result_of(messages)
            assert r["stdout"] == "6\n", r  # df persisted from the first call
            assert r["error"]["name"] == "ZeroDivisionError" and r["reason"] == "error", r
            assert not block.get("is_error"), "an exception is a result to read, not a tool failure"
            return anthropic_turn(tool_use("run_code", {"code": "import matplotlib.pyplot as plt\nplt.plot(df['v'])\nplt.show()"}))

        def last(messages):
            _, r = result_of(messages)
            assert r["images"] == 1 and r["reason"] == "finished", r
            return anthropic_turn(text("The sum is 6."))

        model = Scripted(
            lambda m: anthropic_turn(tool_use("run_code", {"code": "import pandas as pd\ndf = pd.DataFrame({'v': [1, 2, 3]})\nprint('loaded', len(df), 'rows')"})),
            second, third, last,
        )
        out = run_agent(model, tools, "Load the data and sum it.", max_iterations=6)
        assert out.stop_reason == "done" and out.final_text == "The sum is 6.", out
        assert out.tool_calls == 3 and out.tool_errors == 0, out


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
            print("ok", name)
