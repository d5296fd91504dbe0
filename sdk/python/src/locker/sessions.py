"""One sandbox per agent session, for workers that serve a hosted agent loop's tool calls
(Claude Managed Agents' custom tools, OpenAI Agents API sessions, any loop that runs
elsewhere and sends its tool calls here): the session's first call makes its sandbox,
later calls reuse it — also from another worker process or after a restart, since the
sandbox carries the session id in its metadata (`locker-session`) — and `end` deletes it.
Sandboxes of sessions that just stop calling are reclaimed by Locker (`idle_timeout_s`
pauses them, `ttl_s` destroys them).

    sessions = SessionSandboxes(Client(), network={"egress": "none"})
    sb = sessions.get(event["session_id"])      # then BashTool(sb), TextEditorTool(sb), …
    sessions.end(event["session_id"])

Owns no route: it uses `client.sandboxes`. Thread-safe.
"""

import threading
from typing import Any, Dict, List

from .client import Client, LockerError, Sandbox

SESSION_KEY = "locker-session"


class SessionSandboxes:
    def __init__(self, client: Client, **create_options: Any):
        """`create_options`: how each session's sandbox is made (`client.sandboxes.create`;
        default no network and a 2 h TTL)."""
        self.client = client
        self.create_options = {"network": {"egress": "none"}, "ttl_s": 7200, **create_options}
        self._live: Dict[str, Sandbox] = {}
        self._lock = threading.Lock()
        self._session_locks: Dict[str, threading.Lock] = {}

    def _session_lock(self, session_id: str) -> threading.Lock:
        with self._lock:
            return self._session_locks.setdefault(session_id, threading.Lock())

    def get(self, session_id: str) -> Sandbox:
        """The session's sandbox: this worker's, else one another worker made (resumed if
        paused), else a new one."""
        if not session_id:
            raise ValueError("a session id is required")
        with self._session_lock(session_id):
            sb = self._live.get(session_id)
            if sb is not None:
                return sb
            for s in self.client.sandboxes.list(**{SESSION_KEY: session_id}):
                if s.state in ("running", "paused", "starting"):
                    if s.state == "paused":
                        s.resume()
                    sb = s
                    break
            if sb is None:
                metadata = {**self.create_options.get("metadata", {}), SESSION_KEY: session_id}
                sb = self.client.sandboxes.create(**{**self.create_options, "metadata": metadata})
            self._live[session_id] = sb
            return sb

    def end(self, session_id: str) -> None:
        """The session ended: its sandbox is deleted (wherever it was made)."""
        with self._session_lock(session_id):
            mine = self._live.pop(session_id, None)
            ids = {s.id for s in self.client.sandboxes.list(**{SESSION_KEY: session_id})}
            if mine is not None:
                ids.add(mine.id)
            for sid in ids:
                try:
                    self.client.sandboxes.delete(sid)
                except LockerError as e:
                    if e.status != 404:
                        raise

    def sessions(self) -> List[str]:
        """The sessions this worker holds a sandbox for."""
        with self._lock:
            return list(self._live)
