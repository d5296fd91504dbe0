"""The agent loop against scripted stand-in models: parallel tool calls with all results in
one message, failing tools returned as results, the iteration cap stopping an endless
loop, and large results truncated into a file of the sandbox."""

import json
import time

from standin import Scripted, anthropic_turn, endless, text, tool_use

from locker import FunctionTool, Toolkit, ToolResult, run_agent
from locker.agent import RESULTS_DIR
from locker.anthropic import BashTool, TextEditorTool
from locker.functions import ShellTool, function_tools


def boom(_input):
    raise RuntimeError("the flaky tool broke")


def test_parallel_calls_failures_and_one_result_message(sandbox):
    kit = Toolkit([BashTool(sandbox), TextEditorTool(sandbox), FunctionTool("flaky", boom, "always fails")])
    sandbox.files.write("/root/there.py", "present\n")
    turn1 = [
        tool_use("bash", {"command": "sleep 1; echo one"}),
        tool_use("str_replace_based_edit_tool", {"command": "create", "path": "/root/hello.py", "file_text": "print('hi')\n"}),
        tool_use("bash", {"command": "sleep 1; echo two"}),
        tool_use("flaky", {}),
        tool_use("no_such_tool", {"x": 1}),
        tool_use("str_replace_based_edit_tool", {"command": "str_replace", "path": "/root/there.py", "old_str": "absent", "new_str": "x"}),
        tool_use("bash", {"command": "sleep 1; exit 5"}),
    ]

    def check_results(messages):
        last = messages[-1]
        assert last["role"] == "user", last
        blocks = last["content"]
        assert [b["tool_use_id"] for b in blocks] == [c["id"] for c in turn1], "all results, in order, in one message"
        assert all(b["type"] == "tool_result" for b in blocks)
        assert blocks[0]["content"] == "one\n" and not blocks[0].get("is_error")
        assert "created" in blocks[1]["content"]
        assert blocks[2]["content"] == "two\n"
        assert blocks[3]["is_error"] and "the flaky tool broke" in blocks[3]["content"]
        assert blocks[4]["is_error"] and "Unknown tool 'no_such_tool'" in blocks[4]["content"] and "bash" in blocks[4]["content"]
        assert blocks[5]["is_error"] and "did not appear verbatim" in blocks[5]["content"]
        assert not blocks[6].get("is_error") and "[exit code: 5]" in blocks[6]["content"]
        return anthropic_turn(tool_use("bash", {"command": "python3 /root/hello.py"}))

    model = Scripted(
        lambda m: anthropic_turn(text("Working on it."), *turn1),
        check_results,
        lambda m: anthropic_turn(text("Done: " + m[-1]["content"][0]["content"].strip())),
    )
    started = time.monotonic()
    out = run_agent(model, kit, "Say hi from Python.", max_iterations=10)
    took = time.monotonic() - started
    assert out.stop_reason == "done" and out.iterations == 3 and out.final_text == "Done: hi"
    assert out.tool_calls == 8 and out.tool_errors == 3
    assert took < 2.5, f"three 1-second commands ran in parallel, but the loop took {took:.1f} s"
    roles = [m["role"] for m in out.messages]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant"]
    # the model was offered the Anthropic tool definitions
    tools = model.seen[0][1]
    assert {"type": "bash_20250124", "name": "bash"} in tools
    assert {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"} in tools


def test_iteration_cap_stops_an_endless_loop(sandbox):
    calls = []
    out = run_agent(lambda m, t: calls.append(1) or endless(m), [BashTool(sandbox)], "loop forever", max_iterations=4)
    assert out.stop_reason == "max_iterations" and out.iterations == 4 and len(calls) == 4
    assert out.tool_calls == 4 and out.tool_errors == 0
    assert len(out.messages) == 1 + 4 * 2 and out.messages[-1]["content"][0]["content"] == "again\n"


def test_model_errors_propagate_but_a_bad_tool_input_does_not(sandbox):
    def model(messages, tools):
        if len(messages) == 1:
            return anthropic_turn(tool_use("bash", {"cmd": "wrong key"}), tool_use("str_replace_based_edit_tool", {"command": "view"}))
        blocks = messages[-1]["content"]
        assert all(b["is_error"] for b in blocks), blocks
        return anthropic_turn(text("gave up"))

    out = run_agent(model, [BashTool(sandbox), TextEditorTool(sandbox)], "x", max_iterations=3)
    assert out.stop_reason == "done" and out.tool_errors == 2


def test_large_results_are_truncated_into_a_file(sandbox):
    big = "".join(f"row {i:06d}\n" for i in range(20_000))  # 220000 characters

    def model(messages, tools):
        if len(messages) == 1:
            return anthropic_turn(tool_use("dump", {}), tool_use("bash", {"command": "seq 1 100000"}))
        return anthropic_turn(text("ok"))

    kit = Toolkit([FunctionTool("dump", lambda _: big, "prints a lot"), BashTool(sandbox, max_output_bytes=1_000_000)], sandbox=sandbox)
    out = run_agent(model, kit, "x", max_iterations=3, max_result_chars=3000)
    dump, seq = out.messages[2]["content"]
    t = dump["content"]
    assert len(t) < 3400 and t.startswith("row 000000\n") and t.endswith("row 019999\n")
    assert "characters omitted" in t and f"{RESULTS_DIR}/{dump['tool_use_id']}.txt" in t
    assert sandbox.files.read_text(f"{RESULTS_DIR}/{dump['tool_use_id']}.txt") == big
    s = seq["content"]
    assert s.startswith("1\n2\n") and s.endswith("99999\n100000\n") and RESULTS_DIR in s
    assert sandbox.files.read_text(f"{RESULTS_DIR}/{seq['tool_use_id']}.txt").splitlines()[-1] == "100000"
    # without a sandbox the text says so
    out = run_agent(lambda m, t: anthropic_turn(tool_use("dump", {})) if len(m) == 1 else anthropic_turn(text("ok")),
                    {"dump": FunctionTool("dump", lambda _: big)}, "x", max_result_chars=100)
    assert "not saved" in out.messages[2]["content"][0]["content"]


def chat_turn(*calls, content=None):
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop",
            "message": {"role": "assistant", "content": content, "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)] or None}}]}


def test_openai_chat_loop_with_function_tools(sandbox):
    kit = function_tools(sandbox=sandbox)

    def model(messages, tools):
        assert all(t["type"] == "function" and t["function"]["parameters"]["additionalProperties"] is False for t in tools)
        if len(messages) == 1:
            return chat_turn(("file_write", json.dumps({"path": "/root/x.txt", "content": "a\nb\n"})),
                             ("exec", json.dumps({"shell": "sleep 1; echo hi; exit 2"})),
                             ("exec", "{not json"),
                             ("file_edit", json.dumps({"path": "/root/none.txt", "command": "insert", "insert_line": 0, "new_str": "x"})))
        tool_msgs = messages[-4:]
        assert [m["role"] for m in tool_msgs] == ["tool"] * 4 and [m["tool_call_id"] for m in tool_msgs] == ["call_0", "call_1", "call_2", "call_3"]
        assert json.loads(tool_msgs[1]["content"])["exit_code"] == 2
        assert tool_msgs[2]["content"].startswith("Error: ") and "not valid JSON" in tool_msgs[2]["content"]
        assert "does not exist" in tool_msgs[3]["content"]
        return chat_turn(content="finished")

    out = run_agent(model, kit, [{"role": "user", "content": "go"}], api="openai_chat")
    assert out.stop_reason == "done" and out.final_text == "finished" and out.tool_errors == 2
    assert out.messages[1]["tool_calls"][0]["function"]["name"] == "file_write"
    assert sandbox.files.read_text("/root/x.txt") == "a\nb\n"


def test_openai_responses_loop_with_shell_and_functions(sandbox):
    kit = function_tools(sandbox=sandbox, names=["file_read"]).add(ShellTool(sandbox))
    sandbox.files.write("/root/r.txt", "one\ntwo\n")

    def model(items, tools):
        assert {"type": "shell"} in tools and any(t.get("name") == "file_read" for t in tools)
        if len(items) == 1:
            return {"output": [
                {"type": "shell_call", "call_id": "sh_1", "action": {"commands": ["echo a", "ls /nope", "sleep 5", "echo never"], "timeout_ms": 1500, "max_output_length": 1000}},
                {"type": "function_call", "call_id": "fc_1", "name": "file_read", "arguments": json.dumps({"path": "/root/r.txt", "start_line": 2})},
            ]}
        sh, fc = items[-2:]
        assert sh["type"] == "shell_call_output" and sh["call_id"] == "sh_1" and sh["max_output_length"] == 1000
        o = sh["output"]
        assert len(o) == 3, "the commands after a timeout are not run"
        assert o[0] == {"stdout": "a\n", "stderr": "", "outcome": {"type": "exit", "exit_code": 0}}
        assert o[1]["outcome"] == {"type": "exit", "exit_code": 2} and "No such file" in o[1]["stderr"]
        assert o[2]["outcome"] == {"type": "timeout"}
        assert fc["type"] == "function_call_output" and fc["call_id"] == "fc_1"
        assert json.loads(fc["output"])["content"] == "     2\ttwo"
        return {"output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "bye"}]}]}

    out = run_agent(model, kit, [{"role": "user", "content": "go"}], api="openai_responses")
    assert out.stop_reason == "done" and out.final_text == "bye"


def test_toolkit_accepts_sdk_like_objects():
    class Obj:
        def __init__(self, d):
            self.d = d

        def model_dump(self, exclude_none=False):
            return self.d

    out = run_agent(lambda m, t: Obj(anthropic_turn(text("hello"))), [], "x")
    assert out.final_text == "hello" and out.iterations == 1
    assert ToolResult("x", True).to_anthropic("id") == {"type": "tool_result", "tool_use_id": "id", "content": "x", "is_error": True}
