"""Portable function tools: strict schemas, definitions per API, the dispatcher, and the
tools against a real sandbox and volume."""

import json

import pytest

from locker.functions import dispatch, function_tools, strict_schema

NAMES = ["exec", "process_start", "process_output", "process_stop", "run", "file_read", "file_write", "file_edit", "file_list"]


def walk(schema):
    yield schema
    for p in schema.get("properties", {}).values():
        yield from walk(p)
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"])


def test_schemas_and_definitions(sandbox):
    kit = function_tools(sandbox=sandbox, volume="v")
    assert [t.name for t in kit] == NAMES
    for t in kit:
        s = t.parameters
        assert s["type"] == "object" and s["additionalProperties"] is False, t.name
        assert len(t.description) > 150, t.name
        st = strict_schema(s)
        assert sorted(st["required"]) == sorted(st["properties"]) and st["additionalProperties"] is False
        for sub in walk(st):
            assert not {"default", "minimum", "maximum", "minLength", "minItems"} & set(sub), (t.name, sub)
        chat = t.definition("openai_chat", strict=True)
        assert chat["type"] == "function" and chat["function"]["strict"] is True and chat["function"]["name"] == t.name
        resp = t.definition("openai_responses")
        assert resp["type"] == "function" and resp["parameters"] is s
        anth = t.definition("anthropic")
        assert anth["input_schema"] is s
        # Newuser bug 3: no text may tell a model that backgrounding (`nohup … &`) outlives a call.
        assert "nohup cmd > log" not in t.description and "do. cwd" not in t.description, t.name
    assert kit.tools["file_edit"].parameters["properties"]["command"]["enum"] == ["str_replace", "insert"]
    assert strict_schema(kit.tools["run"].parameters)["properties"]["commit"]["enum"][-1] is None
    assert "volume" not in kit.tools["run"].parameters["properties"], "bound to a volume"
    assert function_tools(client=sandbox._c).tools["run"].parameters["required"] == ["volume"]
    with pytest.raises(ValueError):
        function_tools()


def test_dispatch_on_a_sandbox(sandbox):
    kit = function_tools(sandbox=sandbox)
    ok = lambda name, args: json.loads(dispatch(kit, name, json.dumps(args)).content)  # noqa: E731
    r = ok("exec", {"shell": "echo hi; exit 3", "cwd": "/tmp", "timeout_ms": None})  # strict mode sends nulls
    assert r == {"exit_code": 3, "reason": "exited", "stdout": "hi\n", "stderr": ""}
    assert ok("exec", {"cmd": ["sleep", "3"], "timeout_ms": 200})["reason"] == "timeout"
    assert ok("file_write", {"path": "/root/w/a.py", "content": "a = 1\nb = 1\n", "mode": "0755"})["written"]
    r = ok("file_read", {"path": "/root/w/a.py"})
    assert r["content"] == "     1\ta = 1\n     2\tb = 1" and r["total_lines"] == 2
    assert ok("file_list", {"path": "/root/w"})["entries"][0]["path"] == "/root/w/a.py"

    def err(name, args):
        r = dispatch(kit, name, args)
        assert r.is_error, (name, args, r)
        return r.content

    assert "2 times" in err("file_edit", {"path": "/root/w/a.py", "command": "str_replace", "old_str": " = 1", "new_str": " = 2"})
    assert "did not appear verbatim" in err("file_edit", {"path": "/root/w/a.py", "command": "str_replace", "old_str": "a  = 1", "new_str": "x"})
    assert "insert_line" in err("file_edit", {"path": "/root/w/a.py", "command": "str_replace", "old_str": "a = 1", "new_str": "x", "insert_line": 1})
    assert "[0, 2]" in err("file_edit", {"path": "/root/w/a.py", "command": "insert", "insert_line": 5, "new_str": "x"})
    assert "exactly one" in err("exec", {"shell": "true", "cmd": ["true"]})
    assert "unknown argument" in err("exec", {"shell": "true", "background": True})
    assert "missing required" in err("file_read", {})
    assert "not valid JSON" in err("exec", "{oops")
    assert "Unknown tool" in err("nope", {})
    r = dispatch(kit, "file_edit", {"path": "/root/w/a.py", "command": "str_replace", "old_str": "b = 1", "new_str": "b = 2"})
    assert not r.is_error and "     2\tb = 2" in r.content
    r = dispatch(kit, "file_edit", {"path": "/root/w/a.py", "command": "insert", "insert_line": 0, "new_str": "#!/usr/bin/env python3"})
    assert not r.is_error
    assert sandbox.files.read_text("/root/w/a.py") == "#!/usr/bin/env python3\na = 1\nb = 2\n"
    assert sandbox.files.stat("/root/w/a.py").mode & 0o777 == 0o755


def test_run_and_files_on_a_volume(client, volume):
    kit = function_tools(volume=volume)
    assert "exec" not in kit and "run" in kit
    assert not dispatch(kit, "file_write", {"path": "/app.py", "content": "print(6 * 7)\n"}).is_error
    r = json.loads(dispatch(kit, "run", {"shell": "python3 app.py | tee out.txt", "commit": "on_success"}).content)
    assert r["stdout"] == "42\n" and r["changes"] == {"added": ["/out.txt"], "modified": [], "deleted": [], "committed": True, "conflicts": []}
    assert volume.files.read_text("/out.txt") == "42\n"
    unbound = function_tools(client=client, names=["run"])
    r = json.loads(dispatch(unbound, "run", {"volume": volume.name, "cmd": ["rm", "out.txt"], "commit": "never"}).content)
    assert r["changes"]["deleted"] == ["/out.txt"] and r["changes"]["committed"] is False
    r = dispatch(unbound, "run", {"volume": "no-such-volume", "shell": "true"})
    assert r.is_error and "not_found" in r.content
