"""Anthropic's bash_20250124 and text_editor_20250728 handlers in a real sandbox."""

from locker.anthropic import BashTool, TextEditorTool


def test_bash_feels_persistent_and_restarts(sandbox):
    bash = BashTool(sandbox)
    assert bash.definition() == {"type": "bash_20250124", "name": "bash"}
    r = bash({"command": "mkdir -p /srv/app && cd /srv/app && export GREETING=hello && echo out; echo err >&2"})
    assert not r.is_error and r.content == "out\nerr\n"
    r = bash({"command": "pwd; echo $GREETING"})
    assert r.content == "/srv/app\nhello\n"
    r = bash({"command": "false"})
    assert not r.is_error and r.content == "(no output)\n[exit code: 1]" or r.content.endswith("[exit code: 1]")
    r = bash({"command": "cd /tmp; exit 7"})
    assert not r.is_error and "[exit code: 7]" in r.content
    assert bash({"command": "pwd"}).content == "/tmp\n", "state is kept even when the command exits"
    r = bash({"restart": True})
    assert r.content == "tool has been restarted." and not r.is_error
    assert bash({"command": "pwd; echo ${GREETING:-unset}"}).content == "/root\nunset\n"
    r = bash({})
    assert r.is_error and "command" in r.content
    # two tools on one sandbox are two sessions
    other = BashTool(sandbox)
    bash({"command": "cd /etc"})
    assert other({"command": "pwd"}).content == "/root\n"


def test_bash_timeout_and_truncation(sandbox):
    bash = BashTool(sandbox, timeout_ms=500, max_output_bytes=2000)
    r = bash({"command": "echo started; sleep 10"})
    assert not r.is_error and r.content.startswith("started\n") and "timed out after 0.5 s" in r.content
    assert "nohup" not in r.content and "everything it started" in r.content
    r = bash({"command": "seq 1 20000"})
    assert "omitted" in r.content and r.content.rstrip().endswith("]")
    assert "[output truncated" in r.content and "/var/tmp/locker/" in r.content
    path = r.content.split("the full output is in ")[1].split(" ")[0]
    assert sandbox.files.read_text(path).splitlines()[-1] == "20000"


def test_bash_platform_failure_is_an_error_result(client):
    sb = client.sandboxes.create(ttl_s=60)
    sb.delete()
    r = BashTool(sb)({"command": "echo hi"})
    assert r.is_error and "not_found" in r.content


SRC = "def f():\n    return 1\n\n\ndef g():\n    return 1\n"


def test_editor_view_create(sandbox):
    ed = TextEditorTool(sandbox, max_characters=10_000)
    assert ed.definition() == {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool", "max_characters": 10_000}
    r = ed({"command": "create", "path": "/root/app/main.py", "file_text": SRC})
    assert not r.is_error and "created" in r.content
    r = ed({"command": "view", "path": "/root/app/main.py"})
    assert r.content.endswith("     1\tdef f():\n     2\t    return 1\n     3\t\n     4\t\n     5\tdef g():\n     6\t    return 1")
    r = ed({"command": "view", "path": "/root/app/main.py", "view_range": [5, -1]})
    assert r.content.endswith("     5\tdef g():\n     6\t    return 1") and "     4\t" not in r.content
    r = ed({"command": "view", "path": "/root/app/main.py", "view_range": [2, 2]})
    assert r.content.endswith("     2\t    return 1")
    for bad in ([0, 2], [7, 8], [3, 2], "1-2"):
        r = ed({"command": "view", "path": "/root/app/main.py", "view_range": bad})
        assert r.is_error and "view_range" in r.content, bad
    r = ed({"command": "view", "path": "/root"})
    assert not r.is_error and "/root/app/main.py" in r.content and ".bashrc" not in r.content
    r = ed({"command": "view", "path": "/root/nope.py"})
    assert r.is_error and "does not exist" in r.content
    r = ed({"command": "view", "path": "root/app/main.py"})
    assert r.is_error and "absolute" in r.content
    r = ed({"command": "create", "path": "/root/app/main.py", "file_text": "x = 1\n"})
    assert not r.is_error and "overwritten" in r.content
    strict = TextEditorTool(sandbox, allow_overwrite=False)
    r = strict({"command": "create", "path": "/root/app/main.py", "file_text": "y\n"})
    assert r.is_error and "already exists" in r.content
    assert sandbox.files.read_text("/root/app/main.py") == "x = 1\n"
    r = ed({"command": "view", "path": "/root/app/main.py"})
    long = TextEditorTool(sandbox, max_characters=40)
    sandbox.files.write("/root/long.txt", "".join(f"line {i}\n" for i in range(1, 100)))
    r = long({"command": "view", "path": "/root/long.txt"})
    assert not r.is_error and "cut at 40 characters" in r.content and "view_range [" in r.content


def test_editor_exact_match_rules(sandbox):
    ed = TextEditorTool(sandbox)
    sandbox.files.write("/root/m.py", SRC, mode=0o755)
    # occurs twice: refused, with the lines, nothing changed
    r = ed({"command": "str_replace", "path": "/root/m.py", "old_str": "    return 1", "new_str": "    return 2"})
    assert r.is_error and "2 times" in r.content and "[2, 6]" in r.content
    # not at all (whitespace differs): refused, nothing changed
    r = ed({"command": "str_replace", "path": "/root/m.py", "old_str": "def g():\n  return 1", "new_str": "x"})
    assert r.is_error and "did not appear verbatim" in r.content
    r = ed({"command": "str_replace", "path": "/root/m.py", "old_str": "def g():\n    return 1 ", "new_str": "x"})
    assert r.is_error and "whitespace" in r.content
    r = ed({"command": "str_replace", "path": "/root/m.py", "old_str": "", "new_str": "x"})
    assert r.is_error and "empty" in r.content
    assert sandbox.files.read_text("/root/m.py") == SRC
    # exactly once: replaced, snippet returned, mode kept
    r = ed({"command": "str_replace", "path": "/root/m.py", "old_str": "def g():\n    return 1", "new_str": "def g():\n    return 2"})
    assert not r.is_error and "     6\t    return 2" in r.content
    assert sandbox.files.read_text("/root/m.py") == SRC.replace("return 1\n", "return 2\n").replace("return 2", "return 1", 1)
    assert sandbox.files.stat("/root/m.py").mode & 0o777 == 0o755
    # deletion with an absent new_str
    r = ed({"command": "str_replace", "path": "/root/m.py", "old_str": "\n\ndef g():\n    return 2\n"})
    assert not r.is_error and sandbox.files.read_text("/root/m.py") == "def f():\n    return 1\n"
    # insert: insert_text (20250728) and new_str (older versions) both work
    r = ed({"command": "insert", "path": "/root/m.py", "insert_line": 0, "insert_text": "import os\n"})
    assert not r.is_error
    r = ed({"command": "insert", "path": "/root/m.py", "insert_line": 3, "new_str": "    # end"})
    assert not r.is_error and "     4\t    # end" in r.content
    assert sandbox.files.read_text("/root/m.py") == "import os\ndef f():\n    return 1\n    # end\n"
    r = ed({"command": "insert", "path": "/root/m.py", "insert_line": 9, "insert_text": "x"})
    assert r.is_error and "[0, 4]" in r.content
    r = ed({"command": "insert", "path": "/root/m.py", "insert_line": 1})
    assert r.is_error and "insert_text" in r.content
    r = ed({"command": "undo_edit", "path": "/root/m.py"})
    assert r.is_error and "undo_edit" in r.content
    r = ed({"command": "str_replace", "path": "/root/missing.py", "old_str": "a", "new_str": "b"})
    assert r.is_error and "does not exist" in r.content
    sandbox.files.write("/root/bin.dat", b"\xff\xfe\x00")
    r = ed({"command": "view", "path": "/root/bin.dat"})
    assert r.is_error and "not UTF-8" in r.content


def test_editor_on_a_volume(volume):
    ed = TextEditorTool(volume)
    assert not ed({"command": "create", "path": "/notes.md", "file_text": "a\n"}).is_error
    assert not ed({"command": "str_replace", "path": "/notes.md", "old_str": "a", "new_str": "b"}).is_error
    assert volume.files.read_text("/notes.md") == "b\n"
