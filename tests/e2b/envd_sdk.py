"""E2B's Python SDK, unmodified, against Locker's envd data plane (driven by
tests/e2b_envd.rs with E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY set).

Each check prints `ok <name>`; the first failure raises (non-zero exit) with what it saw.
The sandbox is killed at the end whatever happens.
"""

import asyncio
import base64
import gzip
import io
import sys
import threading
import time

from e2b import AsyncSandbox, CommandExitException, Sandbox, TimeoutException
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType
from e2b.exceptions import NotFoundException


def ok(name):
    print("ok", name, flush=True)


def eq(got, want, what):
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def commands(sbx):
    c = sbx.commands
    r = c.run("echo hi; echo err >&2")
    eq((r.stdout, r.stderr, r.exit_code), ("hi\n", "err\n", 0), "run")
    ok("run")

    try:
        c.run("echo partial; exit 3")
        raise AssertionError("a failing command must raise")
    except CommandExitException as e:
        eq((e.exit_code, e.stdout), (3, "partial\n"), "exit code")
    ok("exit_code")

    r = c.run("echo $FOO-$BAR", envs={"FOO": "a", "BAR": "b"})
    eq(r.stdout, "a-b\n", "envs")
    ok("envs")

    r = c.run("pwd", cwd="/tmp")
    eq(r.stdout, "/tmp\n", "cwd")
    r = c.run("whoami; echo $HOME; pwd")
    eq(r.stdout, "user\n/home/user\n/home/user\n", "default user")
    r = c.run("whoami", user="root")
    eq(r.stdout, "root\n", "root")
    ok("cwd_user")

    out, err = [], []
    r = c.run(
        "for i in 1 2 3; do echo o$i; echo e$i >&2; sleep 0.1; done",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    eq(("".join(out), "".join(err)), ("o1\no2\no3\n", "e1\ne2\ne3\n"), "callbacks")
    ok("callbacks")

    started = time.time()
    try:
        c.run("sleep 30", timeout=2)
        raise AssertionError("a command past its timeout must raise")
    except TimeoutException:
        pass
    if time.time() - started > 15:
        raise AssertionError("the timeout took too long")
    # The process is gone too (the timeout is its lifetime).
    time.sleep(1)
    eq([p for p in c.list() if "sleep 30" in " ".join(p.args)], [], "timed-out process")
    ok("timeout")

    h = c.run("sleep 600", background=True, envs={"LISTED": "yes"}, cwd="/tmp")
    pids = [p.pid for p in c.list()]
    if h.pid not in pids:
        raise AssertionError(f"background pid {h.pid} not in list {pids}")
    listed = [p for p in c.list() if p.pid == h.pid][0]
    eq((listed.cmd, listed.args), ("/bin/bash", ["-l", "-c", "sleep 600"]), "listed config")
    # envd lists the envs and cwd the Start gave.
    eq((listed.envs, listed.cwd), ({"LISTED": "yes"}, "/tmp"), "listed envs and cwd")
    ok("background_list")
    eq(c.kill(h.pid), True, "kill")
    try:
        h.wait()
    except CommandExitException:
        pass
    time.sleep(0.5)
    if h.pid in [p.pid for p in c.list()]:
        raise AssertionError("a killed process is still listed")
    eq(c.kill(h.pid), False, "kill of a gone process")
    eq(c.kill(999999), False, "kill of an unknown pid")
    ok("kill")

    h = c.run("read a; read b; echo got $a $b", background=True, stdin=True)
    c.send_stdin(h.pid, "one\n")
    c.send_stdin(h.pid, "two\n")
    r = h.wait()
    eq(r.stdout, "got one two\n", "stdin")
    h = c.run("cat", background=True, stdin=True)
    c.send_stdin(h.pid, "to eof")
    c.close_stdin(h.pid)
    r = h.wait()
    eq(r.stdout, "to eof", "close_stdin")
    h = c.run("wc -c", background=True, stdin=True)
    c.stream_input(h.pid, iter([b"abc", b"defg", "hi"]))
    c.close_stdin(h.pid)
    eq(h.wait().stdout.strip(), "9", "stream_input")
    ok("stdin")

    h = c.run("sleep 1; echo later", background=True)
    h2 = c.connect(h.pid)
    eq(h2.wait().stdout.endswith("later\n"), True, "connect")
    ok("connect")


def pty(sbx):
    got = bytearray()
    h = sbx.pty.create(PtySize(rows=24, cols=80), timeout=30)
    result = {}

    def wait():
        try:
            result["r"] = h.wait(on_pty=lambda b: got.extend(b))
        except Exception as e:  # noqa: BLE001 - reported below
            result["e"] = e

    t = threading.Thread(target=wait)
    t.start()

    def until(needle):
        deadline = time.time() + 10
        while needle not in got and time.time() < deadline:
            time.sleep(0.1)
        if needle not in got:
            raise AssertionError(f"pty output without {needle!r}: {bytes(got)!r}")

    sbx.pty.send_stdin(h.pid, b"stty size; echo pty-$((40+2))\n")
    until(b"pty-42")
    until(b"24 80")
    sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(h.pid, b"stty size\n")
    until(b"30 100")
    sbx.pty.send_stdin(h.pid, b"exit 0\n")
    t.join(20)
    if "r" not in result:
        raise AssertionError(f"pty wait: {result}")
    eq(result["r"].exit_code, 0, "pty exit")
    ok("pty")


def files(sbx):
    f = sbx.files
    info = f.write("hello.txt", "hello world")
    eq(info.path, "/home/user/hello.txt", "relative write path")
    eq(f.read("hello.txt"), "hello world", "read text")
    eq(f.read("/home/user/hello.txt", format="bytes"), bytearray(b"hello world"), "read bytes")
    blob = bytes(range(256)) * 1000
    f.write("/tmp/blob.bin", blob)
    eq(bytes(f.read("/tmp/blob.bin", format="bytes")), blob, "binary round trip")
    eq(b"".join(f.read("/tmp/blob.bin", format="stream")), blob, "stream read")
    eq(f.read("/tmp/blob.bin", format="bytes", gzip=True), bytearray(blob), "gzip read")
    # A stream uploads as octet-stream; gzip too.
    f.write("/tmp/streamed.bin", io.BytesIO(blob))
    eq(bytes(f.read("/tmp/streamed.bin", format="bytes")), blob, "octet-stream write")
    f.write("/tmp/gz.txt", "zipped text", gzip=True)
    eq(f.read("/tmp/gz.txt"), "zipped text", "gzip write")
    ok("read_write")

    written = f.write_files(
        [
            {"path": "/tmp/many/a.txt", "data": "A"},
            {"path": "/tmp/many/sub/b.txt", "data": b"B"},
            {"path": "c.txt", "data": "C"},
        ]
    )
    eq(sorted(w.path for w in written), ["/home/user/c.txt", "/tmp/many/a.txt", "/tmp/many/sub/b.txt"], "write_files")
    eq(f.read("/tmp/many/sub/b.txt"), "B", "write_files content")
    # What a call creates is its user's: files and the directories made for them.
    r = sbx.commands.run("stat -c %U /tmp/many /tmp/many/sub /tmp/many/sub/b.txt; echo more >> c.txt; cat c.txt")
    eq(r.stdout, "user\nuser\nuser\nCmore\n", "owners")
    f.write("/root/r.txt", "r", user="root")
    eq(sbx.commands.run("stat -c %U /root/r.txt", user="root").stdout, "root\n", "root's file")
    ok("write_files")

    names = sorted(e.name for e in f.list("/tmp/many"))
    eq(names, ["a.txt", "sub"], "list")
    deep = sorted(e.path for e in f.list("/tmp/many", depth=2))
    eq(deep, ["/tmp/many/a.txt", "/tmp/many/sub", "/tmp/many/sub/b.txt"], "list depth 2")
    entry = f.get_info("/tmp/many/a.txt")
    eq((entry.name, entry.type.value, entry.size), ("a.txt", "file", 1), "get_info")
    ok("list")

    eq(f.exists("/tmp/many/a.txt"), True, "exists")
    eq(f.exists("/tmp/nope"), False, "exists missing")
    eq(f.make_dir("/tmp/newdir/x"), True, "make_dir")
    eq(f.make_dir("/tmp/newdir/x"), False, "make_dir again")
    moved = f.rename("/tmp/many/a.txt", "/tmp/newdir/a2.txt")
    eq(moved.path, "/tmp/newdir/a2.txt", "rename")
    eq(f.exists("/tmp/many/a.txt"), False, "renamed away")
    f.remove("/tmp/newdir")
    eq(f.exists("/tmp/newdir"), False, "remove")
    try:
        f.read("/tmp/nope.txt")
        raise AssertionError("reading a missing file must raise")
    except NotFoundException:
        pass
    ok("exists_remove_rename")

    f.make_dir("/tmp/watched")
    w = f.watch_dir("/tmp/watched")
    f.write("/tmp/watched/new.txt", "x")
    sbx.commands.run("echo more >> /tmp/watched/new.txt; rm /tmp/watched/new.txt")
    time.sleep(1)
    events = w.get_new_events()
    w.stop()
    kinds = {(e.name, e.type) for e in events}
    for want in [("new.txt", FilesystemEventType.CREATE), ("new.txt", FilesystemEventType.WRITE), ("new.txt", FilesystemEventType.REMOVE)]:
        if want not in kinds:
            raise AssertionError(f"watch: {want} not in {kinds}")
    ok("watch")


async def watch_stream():
    # A sandbox of its own (the async SDK's watch is the streaming WatchDir).
    sbx = await AsyncSandbox.create()
    try:
        await watch_in(sbx)
    finally:
        await sbx.kill()


async def watch_in(sbx):
    events = []
    await sbx.files.make_dir("/tmp/awatch")
    h = await sbx.files.watch_dir("/tmp/awatch", on_event=events.append, recursive=True)
    await sbx.files.make_dir("/tmp/awatch/d")
    await asyncio.sleep(0.3)
    await sbx.files.write("/tmp/awatch/d/f.txt", "y")
    for _ in range(50):
        if any(e.name == "d/f.txt" for e in events):
            break
        await asyncio.sleep(0.1)
    await h.stop()
    names = {(e.name, e.type) for e in events}
    if ("d", FilesystemEventType.CREATE) not in names or ("d/f.txt", FilesystemEventType.CREATE) not in names:
        raise AssertionError(f"recursive WatchDir stream: {names}")
    ok("watch_stream")


def main():
    sbx = Sandbox.create()
    try:
        # E2B's templates have the user `user`; create it where the template does not yet.
        sbx.commands.run("id user >/dev/null 2>&1 || useradd -m -s /bin/bash user", user="root")
        commands(sbx)
        pty(sbx)
        files(sbx)
        asyncio.run(watch_stream())
        eq(sbx.is_running(), True, "health")
        ok("health")
    finally:
        sbx.kill()
    print("done", flush=True)


if __name__ == "__main__":
    main()
