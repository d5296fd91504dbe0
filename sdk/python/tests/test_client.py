"""The HTTP client against a real server: sandboxes, exec, streams, files, processes,
volumes, runs, and errors (LockerError only for platform failures)."""

import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from locker import Changes, Client, Entry, ExecResult, LockerError


def test_exec_results_are_results_not_errors(sandbox):
    r = sandbox.exec(shell="echo hi; echo oops >&2; exit 3")
    assert isinstance(r, ExecResult)
    assert (r.exit_code, r.reason, r.stdout, r.stderr, r.ok) == (3, "exited", "hi\n", "oops\n", False)
    assert r.call_id.startswith("call_") and r.changes is None
    r = sandbox.exec(["python3", "-c", "import sys; print(sys.stdin.read().upper())"], stdin="abc", cwd="/tmp", env={"K": "V"})
    assert r.ok and r.stdout == "ABC\n"
    r = sandbox.exec(shell="sleep 5", timeout_ms=300)
    assert r.reason == "timeout" and r.exit_code is None
    r = sandbox.exec(shell="head -c 5000 /dev/zero | tr '\\0' x; echo; echo END", max_output_bytes=1000)
    assert r.stdout_truncated and r.stdout_bytes == 5005 and r.output_path and r.stdout.endswith("END\n")
    assert len(sandbox.files.read(r.output_path)) == 5005
    with pytest.raises(ValueError):
        sandbox.exec("echo a string is not argv")


def test_exec_stream(sandbox):
    events = list(sandbox.exec_stream(shell="echo a; sleep 0.1; echo b >&2; exit 2"))
    kinds = [e.type for e in events]
    assert kinds[-1] == "result" and "stdout" in kinds and "stderr" in kinds
    assert "".join(e.data for e in events if e.type == "stdout") == "a\n"
    assert events[-1].result.exit_code == 2


def test_bytes_stay_bytes_and_stdin_streams(sandbox):
    blob = bytes(range(256)) * 40
    r = sandbox.exec(["cat"], stdin=blob)
    assert r.ok and r.stdout_raw == blob and r.stdout_b64 is not None
    assert sandbox.exec(shell="echo text").stdout_b64 is None
    events = list(sandbox.exec_stream(["cat"], stdin_b64=__import__("base64").b64encode(blob).decode()))
    assert b"".join(e.data_raw for e in events if e.type == "stdout") == blob

    # A stream: 40 MiB from a generator, never held whole, counted and hashed inside.
    import hashlib
    h = hashlib.sha256()

    def gen():
        for i in range(40):
            b = bytes([i]) * (1 << 20)
            h.update(b)
            yield b

    r = sandbox.exec(shell="tee /tmp/in | sha256sum | cut -d' ' -f1; wc -c < /tmp/in", stdin=gen(), timeout_ms=120000)
    assert r.ok, r
    digest, size = r.stdout.split()
    assert (digest, int(size)) == (h.hexdigest(), 40 << 20)
    # A command that stops reading early ends the call at once.
    import io
    r = sandbox.exec(["head", "-c", "3"], stdin=io.BytesIO(b"abcdef" * 1000000))
    assert r.ok and r.stdout == "abc"


def test_sandbox_lifecycle_and_errors(client):
    sb = client.sandboxes.create(ttl_s=120, metadata={"who": "lifecycle"})
    assert sb.id.startswith("sb_") and sb.state == "running"
    assert client.sandboxes.get(sb.id).info["metadata"] == {"who": "lifecycle"}
    assert sb.id in [s.id for s in client.sandboxes.list(who="lifecycle")]
    sb.set_ttl(300)
    sb.delete()
    with pytest.raises(LockerError) as e:
        client.sandboxes.get(sb.id)
    assert (e.value.status, e.value.code) == (404, "not_found") and sb.id in e.value.message
    with pytest.raises(LockerError) as e:
        Client(client.url, "lk_wrong").sandboxes.list()
    assert (e.value.status, e.value.code) == (401, "unauthorized")
    with pytest.raises(LockerError) as e:
        Client("http://127.0.0.1:9", "k").health()
    assert (e.value.status, e.value.code) == (0, "unreachable")


def test_files(sandbox):
    f = sandbox.files
    e = f.write("/root/d/a.txt", "hello\n", mode=0o755)
    assert isinstance(e, Entry) and e.size == 6 and e.mode & 0o777 == 0o755
    assert f.read("/root/d/a.txt") == b"hello\n" and f.read_text("/root/d/a.txt") == "hello\n"
    f.write("/root/d/bin", bytes(range(256)))
    assert f.read("/root/d/bin") == bytes(range(256))
    assert f.mkdir("/root/d/sub").is_dir
    assert f.move("/root/d/a.txt", "/root/d/sub/b.txt").path == "/root/d/sub/b.txt"
    names = sorted(x.path for x in f.list("/root/d", depth=2))
    assert names == ["/root/d/bin", "/root/d/sub", "/root/d/sub/b.txt"]
    assert f.exists("/root/d/sub/b.txt") and not f.exists("/root/d/a.txt")
    with pytest.raises(LockerError) as err:
        f.read("/root/missing")
    assert err.value.status == 404
    with pytest.raises(LockerError) as err:
        f.remove("/root/d")
    assert err.value.status in (400, 409)
    f.remove("/root/d", recursive=True)
    assert not f.exists("/root/d")


def test_background_processes(sandbox):
    p = sandbox.processes.start(shell="read x; echo got $x; read y; echo got $y")
    assert p.id.startswith("proc_")
    p.write_stdin("one\n")
    deadline = time.time() + 10
    while "got one" not in p.output().stdout:
        assert time.time() < deadline, "no output"
        time.sleep(0.05)
    assert p.output().running
    p.write_stdin("two\n", close=True)
    r = p.wait(timeout=30)
    assert r.exit_code == 0 and r.stdout == "got one\ngot two\n"
    assert any(x.id == p.id for x in sandbox.processes.list())
    q = sandbox.processes.start(shell="sleep 60")
    q.signal("SIGTERM")
    r = q.wait(timeout=30)
    assert r.exit_code is None and r.signal == "SIGTERM"


def test_volumes_and_runs(client, volume):
    assert volume.id.startswith("vol_")
    assert volume.name in [v.name for v in client.volumes.list()]
    assert client.volumes.get(volume.name).id == volume.id
    volume.files.write("/src/keep.txt", "1\n")
    volume.files.write("/src/old.txt", "x\n")
    r = client.run(volume.name, shell="echo 2 >> src/keep.txt; rm src/old.txt; mkdir out; echo hi > out/new.txt; pwd")
    assert r.ok and r.stdout == "/workspace\n"
    assert isinstance(r.changes, Changes) and r.changes.committed
    assert r.changes.added == ["/out", "/out/new.txt"]
    assert r.changes.modified == ["/src/keep.txt"] and r.changes.deleted == ["/src/old.txt"]
    assert volume.files.read_text("/src/keep.txt") == "1\n2\n"
    # on_success with a failing command, and never: nothing is applied
    r = volume.run(shell="echo no > fail.txt; exit 1", commit="on_success")
    assert r.exit_code == 1 and r.changes.added == ["/fail.txt"] and not r.changes.committed
    r = volume.run(["sh", "-c", "echo dry > dry.txt"], commit="never")
    assert r.ok and not r.changes.committed
    assert not volume.files.exists("/fail.txt") and not volume.files.exists("/dry.txt")
    with pytest.raises(LockerError) as e:
        client.run(volume.name, shell="true", commit="sometimes")
    assert e.value.status in (400, 422)
    with pytest.raises(LockerError) as e:
        client.volumes.create(volume.name)
    assert (e.value.status, e.value.code) == (409, "conflict")
    assert client.volumes.get_or_create(volume.name).id == volume.id


def test_a_job_serves_a_port_reached_by_url(client, sandbox):
    # A server started with `&` outlives its exec; the path proxy reaches it with the key.
    sandbox.exec(shell="mkdir -p /tmp/www && echo hi > /tmp/www/x.txt && cd /tmp/www && python3 -m http.server 8123 &")
    deadline = time.time() + 30
    while not any(p["port"] == 8123 for p in sandbox.ports()):
        assert time.time() < deadline, sandbox.ports()
        time.sleep(0.2)
    url = sandbox.url(8123, "/x.txt")
    assert url.endswith(f"/v1/sandboxes/{sandbox.id}/ports/8123/x.txt")
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {client.api_key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        assert r.read() == b"hi\n"
    with pytest.raises(ValueError):
        sandbox.url(0)


def _get(url, host=None, headers=None):
    """GET `url` from the test server's own address with `Host: host` (Python's resolver
    does not know `*.localhost` the way browsers do); status and body, errors included."""
    parts = urllib.parse.urlsplit(url)
    h = dict(headers or {})
    h["Host"] = host or parts.netloc
    req = urllib.request.Request(url, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_an_exposed_port_opens_its_preview_url_to_anyone(client, sandbox):
    sandbox.exec(shell="mkdir -p /tmp/pv && echo pv > /tmp/pv/x.txt && cd /tmp/pv && python3 -m http.server 8124 &")
    deadline = time.time() + 30
    while not any(p["port"] == 8124 for p in sandbox.ports()):
        assert time.time() < deadline, sandbox.ports()
        time.sleep(0.2)
    preview = sandbox.preview_url(8124, "/x.txt", token=False)
    assert preview is not None and preview.startswith(f"http://8124-{sandbox.id}.localhost:"), preview
    host = urllib.parse.urlsplit(preview).netloc
    direct = client.url + "/x.txt"
    assert _get(direct, host)[0] == 401
    # The token in the URL: a redirect that sets the cookie (urllib follows it without one).
    with_token = sandbox.preview_url(8124, "/x.txt")
    assert "locker_token=lpt_" in with_token
    assert _get(direct, host, {"X-Locker-Token": sandbox.info["preview_token"]}) == (200, b"pv\n")
    url = sandbox.expose(8124)
    assert url == preview.rsplit("/", 1)[0] + "/", (url, preview)
    assert _get(direct, host) == (200, b"pv\n")
    assert [p["public"] for p in sandbox.ports() if p["port"] == 8124] == [True]
    sandbox.expose(8124, public=False)
    assert _get(direct, host)[0] == 401
    old = sandbox.info["preview_token"]
    new = sandbox.rotate_preview_token()
    assert new != old
    assert _get(direct, host, {"X-Locker-Token": old})[0] == 401
    assert _get(direct, host, {"X-Locker-Token": new}) == (200, b"pv\n")


def test_usage_counts_the_tenants_execs(client, sandbox):
    before = client.usage()
    assert {"cpu_ms", "sandbox_seconds", "runs", "execs"} <= set(before)
    sandbox.exec(["true"])
    sandbox.exec(["true"])
    assert client.usage()["execs"] >= before["execs"] + 2
    assert client.usage(since="2999-01-01T00:00:00Z")["execs"] == 0
