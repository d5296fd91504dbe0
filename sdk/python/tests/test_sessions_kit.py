"""One sandbox per hosted-loop session (`locker.sessions.SessionSandboxes`): reused for the
session's calls, found again by another worker through its metadata (resumed if paused),
separate between sessions, deleted at the session's end from any worker."""

import uuid

from locker.sessions import SESSION_KEY, SessionSandboxes


def test_each_session_gets_its_own_sandbox_found_again_and_deleted_at_its_end(client):
    tag = f"py-sessions-{uuid.uuid4().hex[:8]}"
    worker = SessionSandboxes(client, metadata={"suite": tag})
    a, b = worker.get(f"{tag}-a"), worker.get(f"{tag}-b")
    try:
        assert a.id != b.id
        assert worker.get(f"{tag}-a").id == a.id
        assert a.info["metadata"][SESSION_KEY] == f"{tag}-a" and a.info["network"]["egress"] == "none"
        a.files.write("/root/mine.txt", "a")
        assert not b.files.exists("/root/mine.txt")
        a.pause()
        again = SessionSandboxes(client).get(f"{tag}-a")
        assert again.id == a.id and again.refresh().state == "running"
        assert sorted(worker.sessions()) == [f"{tag}-a", f"{tag}-b"]
        SessionSandboxes(client).end(f"{tag}-a")
        assert [s.id for s in client.sandboxes.list(suite=tag)] == [b.id]
        assert SessionSandboxes(client, metadata={"suite": tag}).get(f"{tag}-a").id != a.id, "an ended session starts afresh"
    finally:
        worker.end(f"{tag}-a")
        worker.end(f"{tag}-b")
    assert client.sandboxes.list(suite=tag) == []
