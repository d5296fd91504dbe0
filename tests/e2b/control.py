"""E2B's control plane through the unmodified Python SDK (`e2b`), against Locker.

Run by tests/e2b_control.rs with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY pointing at a
test server: `python control.py SCENARIO [ARG]`. Each scenario asserts what a user of the
SDK relies on and prints `ok SCENARIO` at the end; any failure exits non-zero with the
traceback. OTHER_KEY (a second tenant's key) is set for `tenants`.
"""

import datetime
import os
import sys
import time
import uuid

from e2b import Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import AuthenticationException, SandboxException, NotFoundException

try:
    from e2b.exceptions import SandboxNotFoundException
except ImportError:  # older SDKs name it NotFoundException only
    SandboxNotFoundException = NotFoundException


def lifecycle():
    tag = uuid.uuid4().hex
    a = Sandbox.create("base", timeout=120, metadata={"suite": tag, "n": "1"}, envs={"GREETING": "hi"})
    b = Sandbox.create(metadata={"suite": tag, "n": "2"})
    try:
        assert a.sandbox_id.startswith("sb_"), a.sandbox_id
        info = a.get_info()
        assert info.sandbox_id == a.sandbox_id
        assert info.state == SandboxState.RUNNING, info.state
        assert info.metadata == {"suite": tag, "n": "1"}, info.metadata
        assert info.template_id == "default", info.template_id
        left = (info.end_at - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
        assert 60 < left <= 121, left

        # The metadata filter finds both, one page at a time (limit 1, X-Next-Token).
        pager = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), limit=1)
        seen = []
        while pager.has_next:
            page = pager.next_items()
            assert len(page) <= 1, page
            seen += [s.sandbox_id for s in page]
        assert sorted(seen) == sorted([a.sandbox_id, b.sandbox_id]), seen
        only = Sandbox.list(query=SandboxQuery(metadata={"suite": tag, "n": "2"})).next_items()
        assert [s.sandbox_id for s in only] == [b.sandbox_id], only

        # set_timeout: the end moves to the timeout from now.
        a.set_timeout(900)
        left = (a.get_info().end_at - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
        assert 800 < left <= 901, left

        # pause: 204, then 409 (False); the state filter sees it paused; connect resumes.
        assert a.pause() is True
        assert a.get_info().state == SandboxState.PAUSED
        assert Sandbox.pause(a.sandbox_id) is False, "a second pause answers 409"
        paused = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}, state=[SandboxState.PAUSED])).next_items()
        assert [s.sandbox_id for s in paused] == [a.sandbox_id], paused
        again = Sandbox.connect(a.sandbox_id, timeout=300)
        assert again.sandbox_id == a.sandbox_id
        assert a.get_info().state == SandboxState.RUNNING

        # metrics: one sample of now.
        m = a.get_metrics()
        assert len(m) == 1 and m[0].mem_total == 512 * 1024 * 1024 and m[0].cpu_count >= 1, m

        # kill: True, then False; info of a killed sandbox is not found.
        assert a.kill() is True
        assert Sandbox.kill(a.sandbox_id) is False
        try:
            Sandbox.get_info(a.sandbox_id)
            raise AssertionError("info of a killed sandbox")
        except SandboxNotFoundException:
            pass
    finally:
        for s in (a, b):
            Sandbox.kill(s.sandbox_id)
    print("ok lifecycle")


def snapshots():
    a = Sandbox.create(timeout=300)
    children = []
    try:
        snap = a.create_snapshot()
        assert snap.snapshot_id.startswith("snap_"), snap
        listed = Sandbox.list_snapshots(sandbox_id=a.sandbox_id).next_items()
        assert [s.snapshot_id for s in listed] == [snap.snapshot_id], listed
        # A sandbox from the snapshot: the snapshot's id is the template.
        c = Sandbox.create(snap.snapshot_id, timeout=120)
        children.append(c)
        assert c.get_info().state == SandboxState.RUNNING
        # fork: two children of a running sandbox.
        forks = a.fork(count=2, timeout=120)
        assert len(forks) == 2, forks
        for f in forks:
            assert not isinstance(f, Exception), f
            children.append(f)
            assert f.sandbox_id != a.sandbox_id
            assert f.get_info().state == SandboxState.RUNNING
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        assert Sandbox.list_snapshots(sandbox_id=a.sandbox_id).next_items() == []
    finally:
        for s in [a] + children:
            Sandbox.kill(s.sandbox_id)
    print("ok snapshots")


def network():
    # An allowlist from the start (a microVM created with no egress has no network device,
    # so its policy could not change later).
    a = Sandbox.create(timeout=120, network={"allow_out": ["example.com"], "deny_out": ["0.0.0.0/0"]})
    try:
        info = a.get_info()
        assert info.allow_internet_access is False, info
        assert info.network["allow_out"] == ["example.com"], info.network
        a.update_network({"allow_out": ["pypi.org", "10.1.2.0/24"], "deny_out": ["0.0.0.0/0"]})
        assert a.get_info().network["allow_out"] == ["pypi.org", "10.1.2.0/24"]
        # A denylist Locker cannot enforce is refused, and nothing changes.
        try:
            a.update_network({"deny_out": ["1.2.3.4"]})
            raise AssertionError("a denylist was accepted")
        except SandboxException as e:
            assert "allowlists" in str(e), e
        assert a.get_info().network["allow_out"] == ["pypi.org", "10.1.2.0/24"]
        # Deny all: no egress at all.
        a.update_network({"deny_out": ["0.0.0.0/0"]})
        assert not a.get_info().network.get("allow_out"), a.get_info().network
    finally:
        a.kill()
    print("ok network")


def tenants():
    a = Sandbox.create(timeout=60)
    try:
        other = os.environ["OTHER_KEY"]
        # Another tenant's key sees nothing of it.
        for call in (
            lambda: Sandbox.get_info(a.sandbox_id, api_key=other),
            lambda: Sandbox.connect(a.sandbox_id, api_key=other),
        ):
            try:
                call()
                raise AssertionError("another tenant reached the sandbox")
            except SandboxNotFoundException:
                pass
        assert Sandbox.kill(a.sandbox_id, api_key=other) is False
        assert a.get_info().state == SandboxState.RUNNING
        assert Sandbox.list(api_key=other).next_items() == []
        # A wrong key is refused before anything else.
        try:
            Sandbox.create(api_key="e2b_" + "0" * 40)
            raise AssertionError("a wrong key created a sandbox")
        except AuthenticationException:
            pass
        # An unknown template says how to get one.
        try:
            Sandbox.create("no-such-template")
            raise AssertionError("an unknown template")
        except SandboxException as e:
            assert "no-such-template" in str(e), e
    finally:
        a.kill()
    print("ok tenants")


def get_host():
    """`get_host(port)` names the preview host of a server in the sandbox (SANDBOX_ID, PORT,
    started by the test): reached with the sandbox's trafficAccessToken, refused without."""
    import http.client, json
    sid, port = os.environ["SANDBOX_ID"], int(os.environ["PORT"])
    sbx = Sandbox.connect(sid)
    host = sbx.get_host(port)
    server = os.environ["E2B_API_URL"].split("//", 1)[1]
    assert host == f"{port}-{sid}.localhost:{server.rsplit(':', 1)[1]}", host
    def get(headers):
        conn = http.client.HTTPConnection(server, timeout=30)
        conn.request("GET", "/hello?x=1", headers={"Host": host, **headers})
        r = conn.getresponse()
        return r.status, r.read()
    status, body = get({"E2b-Traffic-Access-Token": sbx.traffic_access_token})
    assert status == 200, (status, body)
    seen = json.loads(body)
    assert seen["path"] == "/hello?x=1", seen
    assert "e2b-traffic-access-token" not in seen["headers"], "the token reached the machine"
    status, body = get({})
    assert status == 401, (status, body)
    print("ok get_host")


def old_create():
    """The 2.x SDK before 2.51 (POST /sandboxes, 15 s default timeout on the server side)."""
    a = Sandbox.create(timeout=60, metadata={"old": "yes"})
    try:
        info = a.get_info()
        assert info.metadata == {"old": "yes"}, info.metadata
        assert info.state == SandboxState.RUNNING
        assert a.is_running() in (True, False)  # reaches /health through E2B_SANDBOX_URL
    finally:
        assert a.kill() is True
    print("ok old_create")


if __name__ == "__main__":
    globals()[sys.argv[1]]()
