"""E2B's Python SDK, unmodified, against what Locker's envd serves of envd 0.6.2-0.6.4
(file metadata, watch events with their entry, watches that allow network mounts), a
symlink's Stat, `set_timeout(0)`, and a sandbox killed under a command (driven by tests/e2b_envd.rs with E2B_API_URL /
E2B_SANDBOX_URL / E2B_API_KEY set).

Each check prints `ok <name>`; the first failure raises (non-zero exit) with what it saw.
Every sandbox is killed at the end whatever happens.
"""

import time

from e2b import Sandbox, TimeoutException
from e2b.exceptions import InvalidArgumentException
from e2b.sandbox.filesystem.filesystem import FileType, WriteEntry
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType


def ok(name):
    print("ok", name, flush=True)


def eq(got, want, what):
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def metadata(sbx):
    f = sbx.files
    meta = {"author": "mish", "purpose": "upload"}
    info = f.write("meta.txt", "with metadata", metadata=meta)
    eq(info.metadata, meta, "write answers the metadata")
    eq(f.get_info("meta.txt").metadata, meta, "get_info shows it")
    info = f.write("meta_octet.txt", "x", metadata=meta, use_octet_stream=True)
    eq(info.metadata, meta, "octet-stream write")
    eq(f.get_info("meta_octet.txt").metadata, meta, "octet-stream get_info")
    infos = f.write_files(
        [WriteEntry(path="m1.txt", data="1"), WriteEntry(path="m2.txt", data="2")],
        metadata={"source": "suite"},
    )
    eq([i.metadata for i in infos], [{"source": "suite"}] * 2, "every file of an upload")
    eq(f.get_info("m2.txt").metadata, {"source": "suite"}, "the second file")
    ok("metadata_write")

    plain = f.write("plain.txt", "none")
    eq(plain.metadata, None, "no metadata")
    eq(f.get_info("plain.txt").metadata, None, "no metadata on get_info")
    f.make_dir("metadir")
    f.write("metadir/listed.txt", "c", metadata={"tag": "listed"})
    entry = next(e for e in f.list("metadir") if e.name == "listed.txt")
    eq(entry.metadata, {"tag": "listed"}, "list shows metadata")
    moved = f.rename("metadir/listed.txt", "metadir/moved.txt")
    eq(moved.metadata, {"tag": "listed"}, "rename keeps it")
    f.write("over.txt", "first", metadata={"author": "a"})
    eq(f.write("over.txt", "second").metadata, None, "overwrite clears")
    eq(f.get_info("over.txt").metadata, None, "overwrite clears on get_info")
    ok("metadata_list_rename_overwrite")

    path = sbx.commands.run("realpath plain.txt").stdout.strip()
    sbx.commands.run(
        f"python3 -c \"import os; os.setxattr('{path}', 'user.e2b.author', b'mish'); "
        f"os.setxattr('{path}', 'user.other', b'x')\""
    )
    eq(f.get_info("plain.txt").metadata, {"author": "mish"}, "xattrs set in the machine")
    ok("metadata_xattr")

    for bad in ({"bad key": "v"}, {"": "v"}, {"k": "caf\u00e9"}):
        try:
            f.write("bad.txt", "x", metadata=bad)
            raise AssertionError(f"metadata {bad!r} must be refused")
        except InvalidArgumentException:
            pass
    ok("metadata_refused")


def symlink(sbx):
    f = sbx.files
    f.make_dir("linkdir")
    f.write("linkdir/target.txt", "Hello")
    sbx.commands.run("ln -s target.txt link.txt && ln -s link.txt chain.txt", cwd="linkdir")
    home = sbx.commands.run("pwd").stdout.strip()
    for name in ("link.txt", "chain.txt"):
        info = f.get_info(f"linkdir/{name}")
        eq(info.type, FileType.FILE, f"{name}: the target's type")
        eq(info.symlink_target, f"{home}/linkdir/target.txt", f"{name}: resolved target")
        eq(info.name, name, f"{name}: the link's own name")
    ok("symlink_stat")


def watch(sbx):
    f = sbx.files
    f.make_dir("watched")
    f.write("watched/a.txt", "one")
    h = f.watch_dir("watched", include_entry=True)
    f.write("watched/a.txt", "two")
    events = []
    for _ in range(30):
        events += h.get_new_events()
        if any(e.type == FilesystemEventType.WRITE and e.name == "a.txt" for e in events):
            break
        time.sleep(0.1)
    h.stop()
    w = next(e for e in events if e.type == FilesystemEventType.WRITE and e.name == "a.txt")
    if w.entry is None:
        raise AssertionError(f"include_entry: no entry on {w!r}")
    eq((w.entry.name, w.entry.type), ("a.txt", FileType.FILE), "event entry")
    eq(w.entry.path.endswith("/watched/a.txt"), True, f"event entry path {w.entry.path}")
    ok("watch_include_entry")

    h = f.watch_dir("watched", allow_network_mounts=True)
    f.write("watched/b.txt", "b")
    events = []
    for _ in range(30):
        events += h.get_new_events()
        if any(e.name == "b.txt" for e in events):
            break
        time.sleep(0.1)
    h.stop()
    eq(any(e.name == "b.txt" for e in events), True, f"events {events!r}")
    ok("watch_network_mounts")


def zero_timeout():
    # Auto-pause: a timeout of 0 pauses now; connect resumes the same machine.
    sbx = Sandbox.create(
        timeout=60, lifecycle={"on_timeout": {"action": "pause", "keep_memory": None}}
    )
    try:
        sbx.commands.run("echo kept > /tmp/mem")
        sbx.set_timeout(0)
        for _ in range(50):
            if not sbx.is_running():
                break
            time.sleep(0.2)
        eq(sbx.is_running(), False, "paused by set_timeout(0)")
        again = sbx.connect()
        eq(again.sandbox_id, sbx.sandbox_id, "the same sandbox")
        eq(again.files.read("/tmp/mem"), "kept\n", "what it held")
        ok("set_timeout_zero_pauses")
    finally:
        sbx.kill()

    # Otherwise a timeout of 0 is its end.
    sbx = Sandbox.create(timeout=60)
    try:
        sbx.set_timeout(0)
        eq(sbx.is_running(), False, "ended by set_timeout(0)")
        ok("set_timeout_zero_kills")
    finally:
        sbx.kill()


def killed_under_command():
    # The stream of a command whose sandbox is killed is cut; the SDK probes /health (502)
    # and says the sandbox was killed, as it does on E2B.
    sbx = Sandbox.create()
    try:
        cmd = sbx.commands.run("sleep 60", background=True)
        sbx.kill()
        try:
            cmd.wait()
            raise AssertionError("wait() returned for a command killed with its sandbox")
        except TimeoutException as e:
            if "sandbox was killed or reached its end of life" not in str(e):
                raise AssertionError(f"a command killed with its sandbox: {e}") from e
        ok("killed_under_command")
    finally:
        sbx.kill()


def main():
    sbx = Sandbox.create()
    try:
        sbx.commands.run("id user >/dev/null 2>&1 || useradd -m -s /bin/bash user", user="root")
        metadata(sbx)
        symlink(sbx)
        watch(sbx)
    finally:
        sbx.kill()
    zero_timeout()
    killed_under_command()
    print("done", flush=True)


if __name__ == "__main__":
    main()
