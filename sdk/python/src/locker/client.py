"""A small client of Locker's HTTP API (docs/api.md), on the standard library only.

    from locker import Client
    c = Client("http://127.0.0.1:7070", "lk_...")      # or LOCKER_URL / LOCKER_API_KEY
    sb = c.sandboxes.create(ttl_s=600)
    r = sb.exec(shell="python3 -c 'print(1)'")          # ExecResult; r.exit_code == 0
    sb.files.write("/root/a.txt", "hello")
    sb.delete()

    r = c.run("repo", shell="make test", commit="on_success")   # the serverless call
    r.changes.added, r.changes.committed

A command that exits non-zero, times out or is killed is a result (`ExecResult.reason`),
never an exception. `LockerError(status, code, message)` is raised only when the platform
could not do what was asked (an HTTP error of the API, or the server unreachable).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import ssl
import threading
import urllib.parse
from dataclasses import dataclass, field, fields
from typing import Any, BinaryIO, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from ._records import ProcessInfo, Snapshot, Snapshots, VolumeSnapshot
from ._templates import BuildFailed, Templates

__all__ = [
    "Client",
    "LockerError",
    "ExecResult",
    "Changes",
    "Entry",
    "StreamEvent",
    "ProcessOutput",
    "Sandbox",
    "Volume",
    "Process",
    "ProcessInfo",
    "Files",
    "Snapshot",
    "VolumeSnapshot",
]

DEFAULT_URL = "http://127.0.0.1:7070"


class LockerError(Exception):
    """The platform could not do what was asked.

    `status` is the HTTP status (0 when the server could not be reached), `code` the API's
    error code (`not_found`, `conflict`, `quota_exceeded`, `unavailable`, …; `unreachable`
    when there was no answer) and `message` the server's explanation.
    """

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


def _from_dict(cls, d: Mapping[str, Any]):
    names = {f.name for f in fields(cls)}
    kw = {k: v for k, v in d.items() if k in names}
    obj = cls(**kw)
    obj.raw = dict(d)  # type: ignore[attr-defined]
    return obj


@dataclass
class Changes:
    """What a run on a volume changed (`ExecResult.changes`)."""

    added: List[str] = field(default_factory=list)
    modified: List[str] = field(default_factory=list)
    deleted: List[str] = field(default_factory=list)
    committed: bool = False
    conflicts: List[str] = field(default_factory=list)
    commit_error: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Changes":
        return _from_dict(cls, d)


@dataclass
class ExecResult:
    """The result of every exec and run (docs/api.md, ExecResult)."""

    call_id: str = ""
    exit_code: Optional[int] = None
    signal: Optional[str] = None
    reason: str = "exited"  # exited | signaled | timeout | oom | output_limit | killed
    stdout: str = ""
    stderr: str = ""
    # The same bytes as stdout/stderr, base64, only when they are not valid UTF-8:
    # read them through `stdout_raw` and `stderr_raw`.
    stdout_b64: Optional[str] = None
    stderr_b64: Optional[str] = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    output_path: Optional[str] = None
    timings: Dict[str, float] = field(default_factory=dict)
    usage: Dict[str, int] = field(default_factory=dict)
    changes: Optional[Changes] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExecResult":
        r = _from_dict(cls, d)
        if isinstance(d.get("changes"), Mapping):
            r.changes = Changes.from_dict(d["changes"])
        return r

    @property
    def ok(self) -> bool:
        """Whether the command exited with status 0."""
        return self.reason == "exited" and self.exit_code == 0

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    @property
    def stdout_raw(self) -> bytes:
        """stdout exactly as the command wrote it (binary output included)."""
        return base64.b64decode(self.stdout_b64) if self.stdout_b64 is not None else self.stdout.encode()

    @property
    def stderr_raw(self) -> bytes:
        return base64.b64decode(self.stderr_b64) if self.stderr_b64 is not None else self.stderr.encode()


@dataclass
class Entry:
    """A file, directory or symlink (`files/list`, `files/stat`, a write, mkdir, move)."""

    path: str = ""
    name: str = ""
    type: str = "file"  # file | dir | symlink
    size: int = 0
    mode: int = 0
    mtime: str = ""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Entry":
        return _from_dict(cls, d)

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"


@dataclass
class StreamEvent:
    """One line of an NDJSON stream: `stdout`/`stderr` with `data`, `state`, or the last
    one, `result`, with `result` set."""

    type: str
    data: str = ""
    result: Optional[ExecResult] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def data_raw(self) -> bytes:
        """The chunk exactly as the command wrote it (`data` is its lossy UTF-8 text)."""
        b64 = self.raw.get("data_b64")
        return base64.b64decode(b64) if b64 is not None else self.data.encode()


@dataclass
class ProcessOutput:
    """A background process's output so far, its state, and its result once it ended."""

    stdout: str
    stderr: str
    state: str
    result: Optional[ExecResult] = None

    @property
    def running(self) -> bool:
        return self.result is None and self.state in ("running", "starting")


def _q(**params: Any) -> str:
    p = {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items() if v is not None}
    return ("?" + urllib.parse.urlencode(p)) if p else ""


def _exec_body(
    cmd: Optional[Sequence[str]],
    shell: Optional[str],
    extra: Mapping[str, Any],
) -> Dict[str, Any]:
    if (cmd is None) == (shell is None):
        raise ValueError("give exactly one of cmd (a list of arguments) or shell (a string for /bin/sh -c)")
    body: Dict[str, Any] = {}
    if cmd is not None:
        if isinstance(cmd, str):
            raise ValueError("cmd is a list of arguments; for a command line use shell=")
        body["cmd"] = list(cmd)
    else:
        body["shell"] = shell
    for k, v in extra.items():
        if v is not None:
            body[k] = v
    return body


class Client:
    """A client of one Locker server with one API key.

    `url` defaults to `$LOCKER_URL` (else http://127.0.0.1:7070), `api_key` to
    `$LOCKER_API_KEY`. Thread-safe: every request uses its own connection.
    """

    def __init__(self, url: Optional[str] = None, api_key: Optional[str] = None, timeout: float = 330.0):
        self.url = (url or os.environ.get("LOCKER_URL") or DEFAULT_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("LOCKER_API_KEY")
        self.timeout = timeout
        u = urllib.parse.urlsplit(self.url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {self.url!r}")
        self._scheme = u.scheme
        self._host = u.hostname
        self._port = u.port
        self._prefix = u.path.rstrip("/")
        self.sandboxes = Sandboxes(self)
        self.volumes = Volumes(self)
        self.secrets = Secrets(self)
        self.snapshots = Snapshots(self)
        self.templates = Templates(self)

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    # -- transport ---------------------------------------------------------------------

    def _connect(self, timeout: Optional[float]) -> http.client.HTTPConnection:
        t = self.timeout if timeout is None else timeout
        if self._scheme == "https":
            return http.client.HTTPSConnection(self._host, self._port, timeout=t, context=ssl.create_default_context())
        return http.client.HTTPConnection(self._host, self._port, timeout=t)

    def _open(
        self,
        method: str,
        path: str,
        body: Union[None, bytes, Mapping[str, Any], BinaryIO] = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
    ):
        h = {"Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        data: Any = None
        if isinstance(body, (bytes, bytearray)):
            data = bytes(body)
            h["Content-Type"] = "application/octet-stream"
        elif hasattr(body, "read"):
            # A binary file: streamed by http.client, with its length when it has one (else
            # http.client sends it chunked).
            data = body
            h["Content-Type"] = "application/octet-stream"
            try:
                h["Content-Length"] = str(os.fstat(body.fileno()).st_size - body.tell())  # type: ignore[union-attr]
            except (AttributeError, OSError, ValueError):
                pass
        elif body is not None:
            data = json.dumps(body).encode()
            h["Content-Type"] = "application/json"
        if headers:
            h.update(headers)
        conn = self._connect(timeout)
        try:
            conn.request(method, self._prefix + path, body=data, headers=h)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            what = "timed out" if isinstance(e, socket.timeout) else str(e) or type(e).__name__
            raise LockerError(0, "unreachable", f"{method} {self.url}{path}: {what}") from e
        if resp.status >= 400:
            raw = resp.read()
            conn.close()
            raise self._error(resp.status, raw)
        return conn, resp

    @staticmethod
    def _error(status: int, raw: bytes) -> LockerError:
        try:
            e = json.loads(raw)["error"]
            return LockerError(status, str(e.get("code", "")), str(e.get("message", "")))
        except (ValueError, KeyError, TypeError):
            return LockerError(status, "http_error", raw.decode("utf-8", "replace")[:500] or f"HTTP {status}")

    def request(
        self,
        method: str,
        path: str,
        body: Union[None, bytes, Mapping[str, Any], BinaryIO] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        """One API call; returns the decoded JSON answer (None for 204), raw bytes for an
        octet-stream answer. Raises LockerError on an HTTP error."""
        conn, resp = self._open(method, path, body, timeout=timeout)
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise LockerError(0, "unreachable", f"{method} {path}: reading the answer: {e}") from e
        finally:
            conn.close()
        if resp.status == 204 or not raw:
            return None
        if "json" in (resp.getheader("Content-Type") or ""):
            return json.loads(raw)
        return raw

    def _ndjson(self, method: str, path: str, body: Optional[Mapping[str, Any]] = None, timeout: Optional[float] = None) -> Iterator[Dict[str, Any]]:
        conn, resp = self._open(method, path, body, headers={"Accept": "application/x-ndjson"}, timeout=timeout)
        try:
            while True:
                try:
                    line = resp.readline()
                except (OSError, http.client.HTTPException) as e:
                    raise LockerError(0, "unreachable", f"{method} {path}: the stream broke: {e}") from e
                if not line:
                    return
                line = line.strip()
                if not line:
                    continue
                ev = json.loads(line)
                if ev.get("type") == "error":
                    e = ev.get("error") or {}
                    raise LockerError(resp.status, str(e.get("code", "internal")), str(e.get("message", "")))
                yield ev
        finally:
            conn.close()

    # -- shortcuts ---------------------------------------------------------------------

    def health(self) -> Dict[str, Any]:
        return self.request("GET", "/healthz")

    def sandbox(self, sandbox_id: str) -> "Sandbox":
        """A handle of an existing sandbox, without a request."""
        return Sandbox(self, {"id": sandbox_id})

    def volume(self, volume: str) -> "Volume":
        """A handle of an existing volume (id or name), without a request."""
        return Volume(self, {"id": volume, "name": volume})

    def run(
        self,
        volume: str,
        cmd: Optional[Sequence[str]] = None,
        *,
        shell: Optional[str] = None,
        commit: Optional[str] = None,
        **options: Any,
    ) -> ExecResult:
        """The serverless call: one command in a fresh machine with `volume` (id or name)
        mounted at `mount_path` (default /workspace, also the cwd); the machine is destroyed
        afterwards. `commit`: "always" (default), "on_success" or "never". Other options:
        cwd, env, stdin, timeout_ms (default 60000, at most 300000), max_output_bytes,
        template, runtime ("auto": the jail, "jail" or "microvm"), cpus, memory_mb, network,
        mount_path, secrets (names). Returns the ExecResult with `changes`."""
        body = _exec_body(cmd, shell, dict(options, commit=commit))
        t = (body.get("timeout_ms") or 60000) / 1000 + 60
        return ExecResult.from_dict(self.request("POST", f"/v1/volumes/{_seg(volume)}/run", body, timeout=max(t, self.timeout)))

    def calls(self, sandbox_id: Optional[str] = None, volume_id: Optional[str] = None, limit: Optional[int] = None) -> List[Dict[str, Any]]:
        """The record of execs and runs (`GET /v1/calls`)."""
        return self.request("GET", "/v1/calls" + _q(sandbox_id=sandbox_id, volume_id=volume_id, limit=limit))["calls"]

    def usage(self, since: Optional[str] = None) -> Dict[str, Any]:
        """The tenant's totals (`GET /v1/usage`): cpu_ms, sandbox_seconds, runs, execs and
        the time split, since `since` (an RFC 3339 time) when given."""
        return self.request("GET", "/v1/usage" + _q(since=since))


def _seg(s: str) -> str:
    return urllib.parse.quote(str(s), safe="")


class Files:
    """The files API of a sandbox or a volume. Paths are absolute (inside the machine, or
    from the volume's root)."""

    def __init__(self, client: Client, base: str):
        self._c = client
        self._base = base

    def read(self, path: str) -> bytes:
        """The file's bytes (LockerError 404 if missing, 400 if a directory)."""
        data = self._c.request("GET", f"{self._base}/files" + _q(path=path))
        if data is None:
            return b""
        if isinstance(data, (bytes, bytearray)):
            return bytes(data)
        return json.dumps(data).encode()  # a file whose bytes happened to be sent as JSON

    def read_text(self, path: str, errors: str = "replace") -> str:
        return self.read(path).decode("utf-8", errors)

    def write(self, path: str, data: Union[str, bytes], mode: Optional[Union[int, str]] = None) -> Entry:
        """Create or replace a file (parent directories are created). `mode`: 0o644 or "0644"."""
        if isinstance(data, str):
            data = data.encode()
        if isinstance(mode, int):
            mode = format(mode, "04o")
        return Entry.from_dict(self._c.request("PUT", f"{self._base}/files" + _q(path=path, mode=mode), bytes(data)))

    def list(self, path: str = "/", depth: int = 1) -> List[Entry]:
        d = self._c.request("GET", f"{self._base}/files/list" + _q(path=path, depth=depth))
        return [Entry.from_dict(e) for e in d.get("entries", [])]

    def stat(self, path: str) -> Entry:
        return Entry.from_dict(self._c.request("GET", f"{self._base}/files/stat" + _q(path=path)))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except LockerError as e:
            if e.status == 404:
                return False
            raise

    def mkdir(self, path: str) -> Entry:
        return Entry.from_dict(self._c.request("POST", f"{self._base}/files/mkdir", {"path": path}))

    def remove(self, path: str, recursive: bool = False) -> None:
        self._c.request("DELETE", f"{self._base}/files" + _q(path=path, recursive=recursive))

    def move(self, src: str, dst: str) -> Entry:
        return Entry.from_dict(self._c.request("POST", f"{self._base}/files/move", {"from": src, "to": dst}))


def _process_info(d: Mapping[str, Any]) -> ProcessInfo:
    info = ProcessInfo.from_dict(d)
    if isinstance(d.get("result"), Mapping):
        info.result = ExecResult.from_dict(d["result"])
    return info


class Process:
    """A background process of a sandbox (`sandbox.processes.start`, `.list()`, `.get()`).
    `info` is the last ProcessInfo seen (state, argv, started_at, result), or None before
    `describe()`."""

    def __init__(self, sandbox: "Sandbox", process_id: str, pid: Optional[int] = None, info: Optional[ProcessInfo] = None):
        self.sandbox = sandbox
        self.id = process_id
        self.pid = pid if pid is not None else (info.pid if info is not None else None)
        self.info = info
        self._base = f"/v1/sandboxes/{_seg(sandbox.id)}/processes/{_seg(process_id)}"

    def __repr__(self) -> str:
        state = f", state={self.info.state!r}" if self.info is not None else ""
        return f"Process({self.id!r}, pid={self.pid}{state})"

    @property
    def state(self) -> Optional[str]:
        return self.info.state if self.info is not None else None

    @property
    def result(self) -> Optional["ExecResult"]:
        return self.info.result if self.info is not None else None

    def get(self) -> Dict[str, Any]:
        """`{id, pid, argv, state, started_at, result}` as JSON (see `describe` for it typed)."""
        return self.sandbox._c.request("GET", self._base)

    def describe(self) -> ProcessInfo:
        """Its state now, typed (also kept in `info`)."""
        self.info = _process_info(self.get())
        return self.info

    def output(self, follow: bool = False, timeout: Optional[float] = None) -> ProcessOutput:
        """The output so far (with `follow=True`: wait until the process ends)."""
        out: List[str] = []
        err: List[str] = []
        state = "running"
        result = None
        for ev in self.sandbox._c._ndjson("GET", self._base + "/output" + _q(follow=follow or None), timeout=timeout):
            t = ev.get("type")
            if t == "stdout":
                out.append(ev.get("data", ""))
            elif t == "stderr":
                err.append(ev.get("data", ""))
            elif t == "state":
                state = ev.get("state", state)
            elif t == "result":
                result = ExecResult.from_dict(ev)
                state = "exited"
        if result is not None:
            return ProcessOutput(result.stdout, result.stderr, state, result)
        return ProcessOutput("".join(out), "".join(err), state, None)

    def stream(self, follow: bool = True, timeout: Optional[float] = None) -> Iterator[StreamEvent]:
        for ev in self.sandbox._c._ndjson("GET", self._base + "/output" + _q(follow=follow or None), timeout=timeout):
            yield _event(ev)

    def wait(self, timeout: Optional[float] = None) -> ExecResult:
        """Waits for the process to end and returns its ExecResult."""
        r = self.output(follow=True, timeout=timeout)
        if r.result is None:
            info = self.get()
            if info.get("result"):
                return ExecResult.from_dict(info["result"])
            raise LockerError(0, "unreachable", f"the output stream of {self.id} ended without a result")
        return r.result

    def write_stdin(self, data: Union[str, bytes], close: bool = False) -> None:
        if isinstance(data, str):
            data = data.encode()
        self.sandbox._c.request("POST", self._base + "/stdin" + _q(close=close or None), bytes(data))

    def signal(self, signal: str = "SIGTERM") -> None:
        self.sandbox._c.request("POST", self._base + "/signal", {"signal": signal})

    def kill(self) -> None:
        self.signal("SIGKILL")


class Processes:
    def __init__(self, sandbox: "Sandbox"):
        self._sb = sandbox

    def start(self, cmd: Optional[Sequence[str]] = None, *, shell: Optional[str] = None, **options: Any) -> Process:
        """Starts a command in the background; returns at once. Options as for exec, except
        that a background process has no timeout unless `timeout_ms` is given (at most
        2592000000, the longest a sandbox lives): it runs until it exits, is signalled, or
        its sandbox ends."""
        body = _exec_body(cmd, shell, options)
        d = self._sb._c.request("POST", f"/v1/sandboxes/{_seg(self._sb.id)}/processes", body)
        return Process(self._sb, d["id"], d.get("pid"))

    def list(self) -> List[Process]:
        """The sandbox's background processes, each a Process with `info` set (state,
        argv, started_at, result)."""
        d = self._sb._c.request("GET", f"/v1/sandboxes/{_seg(self._sb.id)}/processes")
        return [Process(self._sb, i.id, info=i) for i in (_process_info(p) for p in d.get("processes", []))]

    def get(self, process_id: str) -> Process:
        return Process(self._sb, process_id)


def _event(ev: Mapping[str, Any]) -> StreamEvent:
    t = ev.get("type", "")
    if t == "result":
        return StreamEvent("result", result=ExecResult.from_dict(ev), raw=dict(ev))
    return StreamEvent(t, data=ev.get("data", ""), raw=dict(ev))


def _port(port: int) -> int:
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port must be 1-65535, got {port!r}")
    return int(port)


class Sandbox:
    """A sandbox: a machine that lives across calls (files, background processes) until
    it is deleted or its TTL ends. `info` is the last Sandbox object seen."""

    def __init__(self, client: Client, info: Mapping[str, Any]):
        self._c = client
        self.info: Dict[str, Any] = dict(info)
        self.id: str = info["id"]
        self.files = Files(client, f"/v1/sandboxes/{_seg(self.id)}")
        self.processes = Processes(self)

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, state={self.info.get('state')!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.delete()
        except LockerError as e:
            if e.status != 404:
                raise

    @property
    def state(self) -> Optional[str]:
        return self.info.get("state")

    def refresh(self) -> "Sandbox":
        self.info = self._c.request("GET", f"/v1/sandboxes/{_seg(self.id)}")
        return self

    def delete(self) -> None:
        self._c.request("DELETE", f"/v1/sandboxes/{_seg(self.id)}")

    def create_code_context(self, language: str = "python", cwd: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> Any:
        """A code context (locker.code.CodeContext): a Jupyter kernel whose variables persist
        between `ctx.run_code(code)` calls. Needs the `code-interpreter` template."""
        from .code import create_code_context
        return create_code_context(self, language, cwd, env)

    def code_contexts(self) -> List[Any]:
        from .code import code_contexts
        return code_contexts(self)

    def run_code(self, code: str, **options: Any) -> Any:
        """Runs a cell in the sandbox's default context (locker.code.run_code's options)."""
        from .code import run_code
        return run_code(self, code, **options)

    def exec(self, cmd: Optional[Sequence[str]] = None, *, shell: Optional[str] = None, **options: Any) -> ExecResult:
        """Runs a command and waits for it: `cmd=["python3", "x.py"]` or `shell="cd app &&
        make"`. Options: cwd (default /root), env, stdin, stdin_b64, timeout_ms (default
        60000), max_output_bytes (default 65536 per stream; the full output is then in
        `output_path`), user. Nothing of the shell persists between calls (cd, export).

        `stdin` is text, bytes, or a stream: a binary file object (anything with `read`)
        or an iterable of bytes chunks, fed to the command as it runs (never held whole in
        memory: gigabytes pass through). Binary output is in `result.stdout_raw`."""
        stdin = options.get("stdin")
        if isinstance(stdin, (bytes, bytearray, memoryview)):
            options = dict(options, stdin=None, stdin_b64=base64.b64encode(bytes(stdin)).decode())
        elif stdin is not None and not isinstance(stdin, str):
            return self._exec_fed(_exec_body(cmd, shell, dict(options, stdin=None)), stdin)
        body = _exec_body(cmd, shell, options)
        t = (body.get("timeout_ms") or 60000) / 1000 + 60
        d = self._c.request("POST", f"/v1/sandboxes/{_seg(self.id)}/exec", body, timeout=max(t, self._c.timeout))
        return ExecResult.from_dict(d)

    def _exec_fed(self, body: Dict[str, Any], source: Any) -> ExecResult:
        """exec with a streamed stdin: a background process whose stdin a thread feeds
        from `source`, in chunks of at most 1 MiB, then closes; its result once it ends."""
        d = self._c.request("POST", f"/v1/sandboxes/{_seg(self.id)}/processes", body)
        proc = Process(self, d["id"], d.get("pid"))

        def chunks() -> Iterator[bytes]:
            if hasattr(source, "read"):
                while True:
                    b = source.read(1 << 20)
                    if not b:
                        return
                    yield b.encode() if isinstance(b, str) else bytes(b)
            else:
                for b in source:
                    yield b.encode() if isinstance(b, str) else bytes(b)

        def feed() -> None:
            try:
                for b in chunks():
                    if b:
                        proc.write_stdin(b)
                proc.write_stdin(b"", close=True)
            except LockerError:
                pass  # the command ended (it stopped reading); its result says how

        feeder = threading.Thread(target=feed, name=f"stdin-{proc.id}", daemon=True)
        feeder.start()
        t = (body.get("timeout_ms") or 60000) / 1000 + 60
        try:
            return proc.wait(timeout=max(t, self._c.timeout))
        except BaseException:
            try:
                proc.kill()
            except LockerError:
                pass
            raise

    def exec_stream(self, cmd: Optional[Sequence[str]] = None, *, shell: Optional[str] = None, **options: Any) -> Iterator[StreamEvent]:
        """Like exec, but yields StreamEvents as output arrives (`stdout`, `stderr`), the last
        one of type `result` with the ExecResult. Closing the iterator early kills the command."""
        body = _exec_body(cmd, shell, options)
        t = (body.get("timeout_ms") or 60000) / 1000 + 60
        for ev in self._c._ndjson("POST", f"/v1/sandboxes/{_seg(self.id)}/exec", body, timeout=max(t, self._c.timeout)):
            yield _event(ev)

    def set_ttl(self, ttl_s: int) -> "Sandbox":
        """expires_at becomes now + ttl_s (1 to 2592000)."""
        self.info = self._c.request("POST", f"/v1/sandboxes/{_seg(self.id)}/ttl", {"ttl_s": ttl_s})
        return self

    def update(self, *, network: Optional[Mapping[str, Any]] = None, metadata: Optional[Mapping[str, str]] = None) -> "Sandbox":
        """Changes the network policy and/or the metadata of the running sandbox
        (`PATCH /v1/sandboxes/{id}`): `network` is {"egress": "none" | "all"} or
        {"egress": "allow", "allow": ["pypi.org", "10.0.0.0/8"]}, enforced by the server from
        the next connection on; `metadata` replaces the labels."""
        body: Dict[str, Any] = {}
        if network is not None:
            body["network"] = dict(network)
        if metadata is not None:
            body["metadata"] = dict(metadata)
        if not body:
            raise ValueError("give network= and/or metadata=")
        self.info = self._c.request("PATCH", f"/v1/sandboxes/{_seg(self.id)}", body)
        return self

    def set_network(self, network: Mapping[str, Any]) -> "Sandbox":
        """`update(network=…)`."""
        return self.update(network=network)

    def set_metadata(self, metadata: Mapping[str, str]) -> "Sandbox":
        """`update(metadata=…)`."""
        return self.update(metadata=metadata)

    @property
    def network(self) -> Optional[Dict[str, Any]]:
        """The egress policy as last seen (`info["network"]`)."""
        return self.info.get("network")

    def ports(self) -> List[Dict[str, Any]]:
        """The TCP ports listening in the sandbox now: dicts with port, address, process,
        pid, public, url (the preview URL where the server has a preview domain) and
        proxy_url (the path proxy's URL, reached with the API key)."""
        return self._c.request("GET", f"/v1/sandboxes/{_seg(self.id)}/ports")["ports"]

    def url(self, port: int, path: str = "/") -> str:
        """The URL that reaches `port` in the sandbox through the server's path proxy
        (send the API key as a Bearer token, as for every call): for code, since it needs
        no DNS name. WebSocket and streamed bodies pass too; a paused sandbox wakes for a
        request. For a browser use `preview_url`."""
        port = _port(port)
        return f"{self._c.url}/v1/sandboxes/{_seg(self.id)}/ports/{port}/{path.lstrip('/')}"

    def preview_url(self, port: int, path: str = "/", token: bool = True) -> Optional[str]:
        """The preview URL of `port` (`http://{port}-{id}.{domain}/…`) for a person's
        browser, with `?locker_token=` unless `token=False` (the server swaps it for a cookie
        for that host); None when the server has no preview domain. A public port (see
        `expose`) needs no token."""
        port = _port(port)
        template = self.info.get("preview_url") or self.refresh().info.get("preview_url")
        if not template:
            return None
        url = template.replace("{port}", str(port)).rstrip("/") + "/" + path.lstrip("/")
        if token and self.info.get("preview_token"):
            url += ("&" if "?" in url else "?") + "locker_token=" + self.info["preview_token"]
        return url

    def expose(self, port: int, public: bool = True) -> str:
        """Opens `port` to anyone with its preview URL (`public=False` makes it private
        again: the API key, the preview token or its cookie) and returns that URL (the path
        proxy's on a server without a preview domain)."""
        port = _port(port)
        d = self._c.request("PUT", f"/v1/sandboxes/{_seg(self.id)}/ports/{port}", {"public": bool(public)})
        return d["url"]

    def rotate_preview_token(self) -> str:
        """A new preview token; the old one and the cookies made from it stop working."""
        d = self._c.request("POST", f"/v1/sandboxes/{_seg(self.id)}/preview-token")
        self.info["preview_token"] = d["preview_token"]
        return d["preview_token"]

    def mcp_server(self, name: str, cmd: Sequence[str], env: Optional[Mapping[str, str]] = None,
                   cwd: Optional[str] = None, request_timeout_s: Optional[int] = None) -> "McpServer":
        """Starts a stdio MCP server in the sandbox (`cmd`, e.g. ["npx", "-y",
        "@modelcontextprotocol/server-filesystem", "/workspace"]) and serves it as Streamable
        HTTP: point any MCP client at `server.url` with `server.headers`. It runs as a
        background process of the sandbox (its limits, its egress policy) and is shared by
        every client; returns once it answered `initialize` (LockerError 502 if it did not:
        the message has the end of its stderr). `name`: 1-64 of a-z, 0-9, - and _.
        `request_timeout_s` (default 300): how long one request may wait for its answer."""
        body: Dict[str, Any] = {"name": name, "cmd": list(cmd)}
        if env is not None:
            body["env"] = dict(env)
        if cwd is not None:
            body["cwd"] = cwd
        if request_timeout_s is not None:
            body["request_timeout_s"] = request_timeout_s
        d = self._c.request("POST", f"/v1/sandboxes/{_seg(self.id)}/mcp", body, timeout=max(90.0, self._c.timeout))
        return McpServer(self, d)

    def mcp_servers(self) -> List["McpServer"]:
        """The MCP servers started in this sandbox (running or exited)."""
        d = self._c.request("GET", f"/v1/sandboxes/{_seg(self.id)}/mcp")
        return [McpServer(self, s) for s in d["servers"]]

    def pause(self) -> None:
        self._c.request("POST", f"/v1/sandboxes/{_seg(self.id)}/pause")

    def resume(self) -> None:
        self._c.request("POST", f"/v1/sandboxes/{_seg(self.id)}/resume")

    def snapshot(self) -> Snapshot:
        """Snapshots its filesystem; `snapshots()` lists them, `client.snapshots.delete(id)`
        deletes one."""
        return Snapshot.from_dict(self._c.request("POST", f"/v1/sandboxes/{_seg(self.id)}/snapshots"))

    def snapshots(self) -> List[Snapshot]:
        """The snapshots taken of this sandbox."""
        return self._c.snapshots.list(sandbox_id=self.id)

    def fork(self, count: int = 1) -> List["Sandbox"]:
        d = self._c.request("POST", f"/v1/sandboxes/{_seg(self.id)}/fork", {"count": count})
        return [Sandbox(self._c, s) for s in d["sandboxes"]]


class McpServer:
    """An MCP server running in a sandbox, reachable as Streamable HTTP at `url` with
    `headers` (the API key). `info` is the last server object seen: name, url, state
    (running | exited), cmd, process_id, pid, server_info, error."""

    def __init__(self, sandbox: Sandbox, info: Mapping[str, Any]):
        self.sandbox = sandbox
        self.info: Dict[str, Any] = dict(info)
        self.name: str = info["name"]

    def __repr__(self) -> str:
        return f"McpServer({self.name!r}, state={self.state!r})"

    def __enter__(self) -> "McpServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        except LockerError as e:
            if e.status != 404:
                raise

    @property
    def url(self) -> str:
        """The server's URL as this client reaches Locker."""
        return f"{self.sandbox._c.url}/v1/sandboxes/{_seg(self.sandbox.id)}/mcp/{_seg(self.name)}"

    @property
    def headers(self) -> Dict[str, str]:
        """What an MCP client must send with every request."""
        key = self.sandbox._c.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    @property
    def state(self) -> Optional[str]:
        return self.info.get("state")

    def refresh(self) -> "McpServer":
        for s in self.sandbox.mcp_servers():
            if s.name == self.name:
                self.info = s.info
                return self
        raise LockerError(404, "not_found", f"no MCP server named {self.name!r} in {self.sandbox.id}")

    def stop(self) -> None:
        """Stops the server (its process ends; open sessions close)."""
        self.sandbox._c.request("DELETE", f"/v1/sandboxes/{_seg(self.sandbox.id)}/mcp/{_seg(self.name)}")


class Sandboxes:
    def __init__(self, client: Client):
        self._c = client

    def create(self, **options: Any) -> Sandbox:
        """Creates a sandbox. Options (docs/api.md): template, runtime, cpus, memory_mb,
        disk_mb, ttl_s (default 1800), idle_timeout_s, env, network, volumes
        ([{"volume": "repo", "path": "/workspace"}]), from_snapshot, metadata, secrets
        (names: each one's env variable holds a placeholder; the egress proxy puts the
        value into requests to the secret's hosts only)."""
        body = {k: v for k, v in options.items() if v is not None}
        return Sandbox(self._c, self._c.request("POST", "/v1/sandboxes", body))

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self._c, self._c.request("GET", f"/v1/sandboxes/{_seg(sandbox_id)}"))

    def list(self, state: Optional[str] = None, **metadata: str) -> List[Sandbox]:
        q = {"state": state, **{f"metadata.{k}": v for k, v in metadata.items()}}
        d = self._c.request("GET", "/v1/sandboxes" + _q(**q))
        return [Sandbox(self._c, s) for s in d.get("sandboxes", [])]

    def delete(self, sandbox_id: str) -> None:
        self._c.request("DELETE", f"/v1/sandboxes/{_seg(sandbox_id)}")


class Volume:
    """A volume: a named persistent disk, reachable by id or name."""

    def __init__(self, client: Client, info: Mapping[str, Any]):
        self._c = client
        self.info: Dict[str, Any] = dict(info)
        self.id: str = info["id"]
        self.name: str = info.get("name") or self.id
        self.files = Files(client, f"/v1/volumes/{_seg(self.id)}")

    def __repr__(self) -> str:
        return f"Volume({self.id!r}, name={self.name!r})"

    @property
    def size_mb(self) -> Optional[int]:
        return self.info.get("size_mb")

    @property
    def used_bytes(self) -> Optional[int]:
        return self.info.get("used_bytes")

    def refresh(self) -> "Volume":
        self.info = self._c.request("GET", f"/v1/volumes/{_seg(self.id)}")
        return self

    def delete(self) -> None:
        self._c.request("DELETE", f"/v1/volumes/{_seg(self.id)}")

    def run(self, cmd: Optional[Sequence[str]] = None, *, shell: Optional[str] = None, commit: Optional[str] = None, **options: Any) -> ExecResult:
        """The serverless call on this volume (see Client.run)."""
        return self._c.run(self.id, cmd, shell=shell, commit=commit, **options)

    def snapshot(self) -> VolumeSnapshot:
        return VolumeSnapshot.from_dict(self._c.request("POST", f"/v1/volumes/{_seg(self.id)}/snapshots"))

    def snapshots(self) -> List[VolumeSnapshot]:
        """Its snapshots, newest first."""
        d = self._c.request("GET", f"/v1/volumes/{_seg(self.id)}/snapshots")
        return [VolumeSnapshot.from_dict(s) for s in d.get("snapshots", [])]

    def delete_snapshot(self, snapshot: Union[str, VolumeSnapshot]) -> None:
        sid = snapshot.id if isinstance(snapshot, VolumeSnapshot) else snapshot
        self._c.request("DELETE", f"/v1/volumes/{_seg(self.id)}/snapshots/{_seg(sid)}")

    def restore(self, snapshot: Union[str, VolumeSnapshot]) -> "Volume":
        """Its tree becomes the snapshot's (409 while a running sandbox mounts it)."""
        sid = snapshot.id if isinstance(snapshot, VolumeSnapshot) else snapshot
        self.info = self._c.request("POST", f"/v1/volumes/{_seg(self.id)}/restore", {"snapshot": sid})
        return self

    def move(self, node: str) -> "Volume":
        """Fleet mode: moves the volume, with its snapshots, to another server of the fleet
        (a node's name or id; one that runs `--node local`). 409 while a running sandbox
        mounts it."""
        self.info = self._c.request("POST", f"/v1/volumes/{_seg(self.id)}/move", {"node": node})
        return self

    def fork(self, name: str, snapshot: Optional[Union[str, VolumeSnapshot]] = None) -> "Volume":
        """A new volume `name`: a copy of this one now, or of one of its snapshots."""
        body: Dict[str, Any] = {"name": name}
        if snapshot is not None:
            body["snapshot"] = snapshot.id if isinstance(snapshot, VolumeSnapshot) else snapshot
        return Volume(self._c, self._c.request("POST", f"/v1/volumes/{_seg(self.id)}/fork", body))


class Secrets:
    """A tenant's secrets: values a machine's code uses but never sees (`/v1/secrets`).
    Nothing here ever returns a value."""

    def __init__(self, client: Client):
        self._c = client

    def create(self, name: str, value: str, hosts: Sequence[str], env: str) -> Dict[str, Any]:
        """Creates secret `name`; machines that name it get `env`=<placeholder>, and the
        egress proxy sends `value` in its place to `hosts` only."""
        return self._c.request("POST", "/v1/secrets", {"name": name, "value": value, "hosts": list(hosts), "env": env})

    def list(self) -> List[Dict[str, Any]]:
        return self._c.request("GET", "/v1/secrets").get("secrets", [])

    def get(self, name: str) -> Dict[str, Any]:
        return self._c.request("GET", f"/v1/secrets/{_seg(name)}")

    def rotate(self, name: str, *, value: Optional[str] = None, hosts: Optional[Sequence[str]] = None, env: Optional[str] = None) -> Dict[str, Any]:
        """Changes the value (next requests use it), the hosts or the env variable."""
        body: Dict[str, Any] = {}
        if value is not None:
            body["value"] = value
        if hosts is not None:
            body["hosts"] = list(hosts)
        if env is not None:
            body["env"] = env
        if not body:
            raise ValueError("give value=, hosts= and/or env=")
        return self._c.request("PUT", f"/v1/secrets/{_seg(name)}", body)

    def delete(self, name: str) -> None:
        self._c.request("DELETE", f"/v1/secrets/{_seg(name)}")


class Volumes:
    def __init__(self, client: Client):
        self._c = client

    def create(self, name: str, size_mb: Optional[int] = None) -> Volume:
        body: Dict[str, Any] = {"name": name}
        if size_mb is not None:
            body["size_mb"] = size_mb
        return Volume(self._c, self._c.request("POST", "/v1/volumes", body))

    def get(self, volume: str) -> Volume:
        return Volume(self._c, self._c.request("GET", f"/v1/volumes/{_seg(volume)}"))

    def get_or_create(self, name: str, size_mb: Optional[int] = None) -> Volume:
        try:
            return self.get(name)
        except LockerError as e:
            if e.status != 404:
                raise
        try:
            return self.create(name, size_mb)
        except LockerError as e:
            if e.status == 409:  # created in between
                return self.get(name)
            raise

    def list(self) -> List[Volume]:
        return [Volume(self._c, v) for v in self._c.request("GET", "/v1/volumes").get("volumes", [])]

    def delete(self, volume: str) -> None:
        self._c.request("DELETE", f"/v1/volumes/{_seg(volume)}")

