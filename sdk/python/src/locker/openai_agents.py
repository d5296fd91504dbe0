"""The OpenAI Agents SDK's sandbox provider backed by Locker: `LockerSandboxClient`, a
`SandboxClient` (as the SDK's Docker and local clients are) whose sessions are Locker
sandboxes, so a `SandboxAgent`'s shell, filesystem and patch tools run in one.

    from agents import Runner
    from agents.run import RunConfig
    from agents.sandbox import SandboxAgent, SandboxRunConfig
    from locker.openai_agents import LockerSandboxClient, LockerSandboxClientOptions

    client = LockerSandboxClient()          # LOCKER_URL / LOCKER_API_KEY, or a locker.Client
    result = await Runner.run(agent, "Fix the test", run_config=RunConfig(sandbox=SandboxRunConfig(
        client=client, options=LockerSandboxClientOptions(network={"egress": "none"}))))

`create` makes a sandbox (options: template, network, cpus, memory_mb, ttl_s — default
3600 —, metadata); the SDK materializes the manifest into `manifest.root` (default
/workspace) through the session's `write` and `exec`; commands run with the manifest's
environment; `persist_workspace`/`hydrate_workspace` are the root as a tar archive (Locker's
files API); exposed ports are made public and answered with their preview URL; `delete`
destroys the sandbox. Needs the `openai-agents` package (this module is the only one of
the SDK that imports it). Owns no route: it goes through `locker.Client`.
"""

from __future__ import annotations

import asyncio
import io
import urllib.parse
from pathlib import Path
from typing import Any, Dict, Literal, Optional

from agents.sandbox.errors import ExposedPortUnavailableError
from agents.sandbox.manifest import Manifest
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
from agents.sandbox.session.sandbox_session import SandboxSession
from agents.sandbox.session.sandbox_session_state import SandboxSessionState
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot
from agents.sandbox.types import ExecResult, ExposedPortEndpoint

from .client import Client, LockerError, Sandbox

__all__ = ["LockerSandboxClient", "LockerSandboxClientOptions", "LockerSandboxSession", "LockerSandboxSessionState"]


class LockerSandboxSessionState(SandboxSessionState):
    """The SDK's session state plus the Locker sandbox it runs in."""

    type: Literal["locker"] = "locker"
    sandbox_id: str = ""


class LockerSandboxClientOptions(BaseSandboxClientOptions):
    """How sandboxes are made (see docs/api.md, `POST /v1/sandboxes`)."""

    type: Literal["locker"] = "locker"
    template: Optional[str] = None
    network: Optional[Dict[str, Any]] = None
    cpus: Optional[int] = None
    memory_mb: Optional[int] = None
    ttl_s: int = 3600
    metadata: Optional[Dict[str, str]] = None
    exec_timeout_ms: int = 600_000

    def __init__(self, template: Optional[str] = None, network: Optional[Dict[str, Any]] = None,
                 cpus: Optional[int] = None, memory_mb: Optional[int] = None, ttl_s: int = 3600,
                 metadata: Optional[Dict[str, str]] = None, exec_timeout_ms: int = 600_000, *,
                 type: Literal["locker"] = "locker") -> None:  # noqa: A002
        super().__init__(type=type, template=template, network=network, cpus=cpus, memory_mb=memory_mb,
                         ttl_s=ttl_s, metadata=metadata, exec_timeout_ms=exec_timeout_ms)


def _missing(e: LockerError) -> bool:
    return e.status == 404


class LockerSandboxSession(BaseSandboxSession):
    """A Locker sandbox as the SDK's sandbox session (no PTY: commands run to their end)."""

    state: LockerSandboxSessionState

    def __init__(self, *, state: LockerSandboxSessionState, sandbox: Sandbox, exec_timeout_ms: int = 600_000) -> None:
        self.state = state
        self.sandbox = sandbox
        self.exec_timeout_ms = exec_timeout_ms

    def _abs(self, path: Path | str) -> str:
        p = str(path)
        if p.startswith("/"):
            return p
        root = str(self.state.manifest.root).rstrip("/")
        return f"{root}/{p}" if p not in ("", ".") else root

    async def _prepare_backend_workspace(self) -> None:
        await asyncio.to_thread(self.sandbox.files.mkdir, str(self.state.manifest.root))

    async def _exec_internal(self, *command: str | Path, timeout: float | None = None) -> ExecResult:
        ms = int(timeout * 1000) if timeout else self.exec_timeout_ms
        # The root exists once the manifest was applied; before (its own mkdir), run from /.
        cwd = str(self.state.manifest.root) if self.state.workspace_root_ready else "/"
        env = await self.state.manifest.environment.resolve()
        r = await asyncio.to_thread(self.sandbox.exec, [str(c) for c in command], cwd=cwd, timeout_ms=ms, env=dict(env) or None)
        code = r.exit_code if r.exit_code is not None else (124 if r.reason == "timeout" else 137)
        return ExecResult(stdout=r.stdout_raw, stderr=r.stderr_raw, exit_code=code)

    async def read(self, path: Path, *, user: Any = None) -> io.IOBase:
        try:
            data = await asyncio.to_thread(self.sandbox.files.read, self._abs(path))
        except LockerError as e:
            if _missing(e):
                raise FileNotFoundError(str(path)) from e
            raise
        return io.BytesIO(data)

    async def write(self, path: Path, data: io.IOBase, *, user: Any = None) -> None:
        payload = data.read()
        if isinstance(payload, str):
            payload = payload.encode("utf-8")
        await asyncio.to_thread(self.sandbox.files.write, self._abs(path), bytes(payload))

    async def running(self) -> bool:
        try:
            await asyncio.to_thread(self.sandbox.refresh)
        except LockerError as e:
            if _missing(e):
                return False
            raise
        return self.sandbox.state == "running"

    async def persist_workspace(self) -> io.IOBase:
        root = str(self.state.manifest.root)
        q = urllib.parse.urlencode({"path": root, "format": "tar"})
        c = self.sandbox._c  # noqa: SLF001
        raw = await asyncio.to_thread(c.request, "GET", f"/v1/sandboxes/{urllib.parse.quote(self.sandbox.id, safe='')}/files?{q}")
        return io.BytesIO(raw)

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        root = str(self.state.manifest.root)
        q = urllib.parse.urlencode({"path": root, "format": "tar"})
        c = self.sandbox._c  # noqa: SLF001
        payload = data.read()
        await asyncio.to_thread(c.request, "PUT", f"/v1/sandboxes/{urllib.parse.quote(self.sandbox.id, safe='')}/files?{q}", bytes(payload))

    async def _resolve_exposed_port(self, port: int) -> ExposedPortEndpoint:
        try:
            url = await asyncio.to_thread(self.sandbox.expose, port)
        except LockerError as e:
            raise ExposedPortUnavailableError(port=port, exposed_ports=self.state.exposed_ports,
                                              reason="backend_unavailable", context={"backend": "locker", "error": e.message}) from e
        u = urllib.parse.urlsplit(url)
        tls = u.scheme == "https"
        return ExposedPortEndpoint(host=u.hostname or "", port=u.port or (443 if tls else 80), tls=tls)

    def supports_pty(self) -> bool:
        return False


class LockerSandboxClient(BaseSandboxClient[Optional[LockerSandboxClientOptions]]):
    """The Agents SDK's sandbox client backed by Locker."""

    backend_id = "locker"
    supports_default_options = True

    def __init__(self, client: Optional[Client] = None) -> None:
        self.client = client or Client()

    async def create(self, *, snapshot: SnapshotSpec | SnapshotBase | None = None, manifest: Manifest | None = None,
                     options: Optional[LockerSandboxClientOptions] = None) -> SandboxSession:
        o = options or LockerSandboxClientOptions()
        manifest = manifest if manifest is not None else Manifest()
        self._validate_manifest_for_create(manifest)
        body: Dict[str, Any] = {"ttl_s": o.ttl_s, "metadata": {**(o.metadata or {}), "openai-agents": "sandbox"}}
        for k in ("template", "network", "cpus", "memory_mb"):
            v = getattr(o, k)
            if v is not None:
                body[k] = v
        sb = await asyncio.to_thread(lambda: self.client.sandboxes.create(**body))
        state = LockerSandboxSessionState(manifest=manifest, snapshot=resolve_snapshot(snapshot, sb.id), sandbox_id=sb.id)
        inner = LockerSandboxSession(state=state, sandbox=sb, exec_timeout_ms=o.exec_timeout_ms)
        return self._wrap_session(inner)

    async def delete(self, session: SandboxSession) -> SandboxSession:
        inner = session._inner  # noqa: SLF001
        if not isinstance(inner, LockerSandboxSession):
            raise TypeError("LockerSandboxClient.delete expects a LockerSandboxSession")
        try:
            await asyncio.to_thread(inner.sandbox.delete)
        except LockerError as e:
            if not _missing(e):
                raise
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        if not isinstance(state, LockerSandboxSessionState):
            raise TypeError("LockerSandboxClient.resume expects a LockerSandboxSessionState")
        sb = await asyncio.to_thread(self.client.sandboxes.get, state.sandbox_id)
        if sb.state == "paused":
            await asyncio.to_thread(sb.resume)
        return self._wrap_session(LockerSandboxSession(state=state, sandbox=sb))

    def deserialize_session_state(self, payload: Dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, LockerSandboxSessionState)
