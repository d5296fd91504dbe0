"""What an agent's code needs beyond exec, against a real server: the network and metadata
of a running sandbox, snapshots listed and deleted (sandbox and volume), background
processes listed as typed objects."""

import time

import pytest

from locker import LockerError, Process, ProcessInfo, Snapshot, VolumeSnapshot
from locker.client import ExecResult


def wait_egress(client):
    """Policies other than none need the server's egress probe to have passed."""
    deadline = time.monotonic() + 20
    while True:
        e = client.health().get("egress")
        if e == "ok":
            return
        assert e == "probing" and time.monotonic() < deadline, f"egress enforcement works on this host: {e}"
        time.sleep(0.1)


def test_network_and_metadata_of_a_running_sandbox_change(client, sandbox):
    wait_egress(client)
    assert sandbox.network == {"egress": "none"}
    assert sandbox.exec(shell="ls /sys/class/net").stdout.split() == ["lo"]
    sb = sandbox.set_network({"egress": "all"})
    assert sb is sandbox and sandbox.network == {"egress": "all"}
    assert sandbox.exec(shell="ls /sys/class/net").stdout.split() != ["lo"], "the server applies it to the machine"
    sandbox.update(network={"egress": "allow", "allow": ["PyPI.org"]})
    assert sandbox.network == {"egress": "allow", "allow": ["pypi.org"]}, "normalized by the server"
    sandbox.set_metadata({"task": "t-12", "owner": "agent"})
    assert sandbox.refresh().info["metadata"] == {"task": "t-12", "owner": "agent"}
    assert [s.id for s in client.sandboxes.list(task="t-12")] == [sandbox.id]
    with pytest.raises(LockerError) as e:
        sandbox.set_network({"egress": "allow"})
    assert e.value.status == 400 and "network.allow" in e.value.message
    with pytest.raises(ValueError):
        sandbox.update()


def test_sandbox_snapshots_are_listed_and_deleted(client, sandbox):
    sandbox.files.write("/root/state.txt", "v1")
    snap = sandbox.snapshot()
    assert isinstance(snap, Snapshot) and snap.id.startswith("snap_") and snap.sandbox_id == sandbox.id
    assert snap["id"] == snap.id, "still readable as the JSON it was"
    assert snap.id in [s.id for s in client.snapshots.list()]
    assert [s.id for s in sandbox.snapshots()] == [snap.id]
    assert all(isinstance(s, Snapshot) for s in client.snapshots.list())
    with client.sandboxes.create(from_snapshot=snap.id, ttl_s=300) as copy:
        assert copy.files.read_text("/root/state.txt") == "v1"
    client.snapshots.delete(snap)
    assert snap.id not in [s.id for s in client.snapshots.list()]
    with pytest.raises(LockerError) as e:
        client.snapshots.delete(snap.id)
    assert e.value.status == 404


def test_volume_snapshots_are_listed_restored_and_deleted(volume):
    volume.files.write("/a.txt", "one")
    snap = volume.snapshot()
    assert isinstance(snap, VolumeSnapshot) and snap.volume_id == volume.id
    volume.files.write("/a.txt", "two")
    assert [s.id for s in volume.snapshots()] == [snap.id]
    volume.restore(snap)
    assert volume.files.read_text("/a.txt") == "one"
    volume.delete_snapshot(snap)
    assert volume.snapshots() == []


def test_processes_list_returns_typed_processes(sandbox):
    p = sandbox.processes.start(shell="echo started; sleep 300")
    procs = sandbox.processes.list()
    mine = [x for x in procs if x.id == p.id]
    assert mine and isinstance(mine[0], Process) and isinstance(mine[0].info, ProcessInfo)
    q = mine[0]
    assert q.pid == p.pid and q.state == "running" and q.info.argv and q.info.started_at and q.result is None
    q.kill()
    r = q.wait(timeout=20)
    assert r.reason in ("signaled", "killed")
    q = [x for x in sandbox.processes.list() if x.id == p.id][0]
    assert q.state == "exited" and isinstance(q.result, ExecResult) and q.result.reason == r.reason
    assert isinstance(q.result.timings, dict) and "run_ms" in q.result.timings
    info = p.describe()
    assert isinstance(info, ProcessInfo) and info.state == "exited" and p.info is info
