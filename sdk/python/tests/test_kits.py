"""The tool kits say what the sandbox is and can do, against a real server: background
processes through function tools (start, read, stop) that outlive a call; descriptions
that follow the sandbox's network policy and promise no tools the template may lack;
unknown input keys of Anthropic's tools named as errors with the valid keys."""

import json

from locker.anthropic import BashTool, TextEditorTool
from locker.functions import background_tools, dispatch, function_tools

from test_sessions import wait_egress


def call(kit, name, args):
    r = dispatch(kit, name, json.dumps(args))
    assert not r.is_error, r.content
    return json.loads(r.content)


def test_background_tools_start_read_and_stop_a_process_that_outlives_the_call(sandbox):
    kit = function_tools(sandbox=sandbox)
    assert {"process_start", "process_output", "process_stop"} <= set(kit.tools)
    srv = call(kit, "process_start", {"shell": "cd /tmp && echo served > index.html && exec python3 -m http.server 8123"})
    assert srv["process_id"].startswith("proc_") and srv["state"] == "running"
    fetch = "import time, urllib.request\nfor _ in range(100):\n    try:\n        print(urllib.request.urlopen('http://127.0.0.1:8123/index.html').read().decode()); break\n    except OSError:\n        time.sleep(0.1)\n"
    r = call(kit, "exec", {"cmd": ["python3", "-c", fetch]})
    assert r["stdout"].strip() == "served", f"the server outlived process_start's call: {r}"
    out = call(kit, "process_output", {"process_id": srv["process_id"]})
    assert out["state"] == "running" and "GET /index.html" in out["stderr"], out
    stop = call(kit, "process_stop", {"process_id": srv["process_id"], "signal": "SIGKILL"})
    assert stop["signal"] == "SIGKILL"
    out = call(kit, "process_output", {"process_id": srv["process_id"], "wait_ms": 10000})
    assert out["state"] == "exited" and out["exit_code"] is None and out["reason"] in ("signaled", "killed"), out

    job = call(kit, "process_start", {"shell": "seq 1 20000; echo done >&2; exit 3"})
    out = call(kit, "process_output", {"process_id": job["process_id"], "wait_ms": 20000, "max_output_bytes": 1024})
    assert out["state"] == "exited" and out["exit_code"] == 3 and out["stderr"] == "done\n", out
    assert out["stdout"].endswith("19999\n20000\n") and "bytes omitted" in out["stdout"], "the last bytes"
    assert len(out["stdout"].encode()) < 1200

    bg = background_tools(sandbox)
    assert sorted(bg.tools) == ["process_output", "process_start", "process_stop"]
    r = dispatch(bg, "process_output", {"process_id": "proc_nope"})
    assert r.is_error and "404" in r.content


def test_descriptions_follow_the_sandbox_and_promise_nothing_else(client, sandbox):
    kit = function_tools(sandbox=sandbox, volume="v")
    exec_d = kit.tools["exec"].description
    assert "No network" in exec_d, "the sandbox's policy is none"
    assert "python3, pip, git, curl" not in exec_d and "Debian" not in exec_d, "no promise about the template's tools"
    assert f"template `{sandbox.info['template']}`" in exec_d
    assert "}}" not in kit.tools["file_read"].description
    for t in kit:
        d = t.description
        assert "{{" not in d and d.count("{") == d.count("}"), (t.name, d)
    assert "No network" in kit.tools["run"].description, "runs get no network unless asked"
    run_all = function_tools(client=client, run_network={"egress": "all"}).tools["run"].description
    assert "No network" not in run_all and "internet" in run_all
    # A handle that has not been fetched: the policy is unknown, so nothing is said.
    bare = function_tools(sandbox=client.sandbox(sandbox.id)).tools["exec"].description
    assert "network" not in bare.lower()

    wait_egress(client)
    with client.sandboxes.create(ttl_s=300, network={"egress": "allow", "allow": ["pypi.org", "files.pythonhosted.org"]}) as sb:
        d = function_tools(sandbox=sb).tools["exec"].description
        assert "No network" not in d and "pypi.org, files.pythonhosted.org" in d, d
        sb.set_network({"egress": "all"})
        d = function_tools(sandbox=sb).tools["process_start"].description
        assert "can reach the internet" in d, d


def test_anthropic_tools_name_the_valid_keys_of_an_unknown_input(sandbox):
    r = BashTool(sandbox)({"command": "echo hi", "timeout": 5})
    assert r.is_error and "['timeout']" in r.content and "command, restart" in r.content, r.content
    ed = TextEditorTool(sandbox)
    r = ed({"command": "create", "path": "/root/x.txt", "file_text": "x", "allow_overwrite": False})
    assert r.is_error and "allow_overwrite" in r.content and "file_text" in r.content and "view_range" in r.content, r.content
    assert not sandbox.files.exists("/root/x.txt"), "nothing was done"
    assert not ed({"command": "create", "path": "/root/x.txt", "file_text": "x"}).is_error
