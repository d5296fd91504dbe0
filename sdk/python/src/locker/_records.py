"""Typed records of the API that are not command results: sandbox and volume snapshots,
and the description of a background process (`GET …/processes`).

Each keeps the JSON it came from in `raw` (fields the server adds later stay reachable)
and can be indexed like that JSON (`snap["id"]`), as the dicts these calls used to return.
Owns no transport: the client's `request` makes the calls.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Union

__all__ = ["Snapshot", "VolumeSnapshot", "ProcessInfo", "Snapshots"]


class _Record:
    raw: Dict[str, Any]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        obj = cls(**{k: v for k, v in d.items() if k in names and k != "raw"})
        obj.raw = dict(d)
        return obj

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)


@dataclass
class Snapshot(_Record):
    """A sandbox snapshot (`snap_…`): `sandbox_id` is the sandbox it was taken of (which
    may be gone); start a sandbox from it with `sandboxes.create(from_snapshot=id)`."""

    id: str = ""
    sandbox_id: str = ""
    template: str = ""
    runtime: str = ""
    size_bytes: int = 0
    has_memory: bool = False
    disk_mb: Optional[int] = None
    created_at: str = ""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class VolumeSnapshot(_Record):
    """A point-in-time copy of a volume (`Volume.snapshot()`), to restore or fork from."""

    id: str = ""
    volume_id: str = ""
    size_bytes: int = 0
    created_at: str = ""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class ProcessInfo(_Record):
    """A background process as the server describes it: `state` is "running" or
    "exited"; `result` (an ExecResult) is set once it exited."""

    id: str = ""
    pid: Optional[int] = None
    argv: List[str] = field(default_factory=list)
    state: str = ""
    started_at: str = ""
    result: Any = None  # ExecResult once it exited
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def running(self) -> bool:
        return self.state == "running"


class Snapshots:
    """The tenant's sandbox snapshots (`client.snapshots`)."""

    def __init__(self, client: Any):
        self._c = client

    def list(self, sandbox_id: Optional[str] = None) -> List[Snapshot]:
        """Every snapshot, or those taken of `sandbox_id`."""
        snaps = [Snapshot.from_dict(s) for s in self._c.request("GET", "/v1/snapshots").get("snapshots", [])]
        return [s for s in snaps if sandbox_id is None or s.sandbox_id == sandbox_id]

    def delete(self, snapshot: Union[str, Snapshot]) -> None:
        sid = snapshot.id if isinstance(snapshot, Snapshot) else snapshot
        self._c.request("DELETE", "/v1/snapshots/" + urllib.parse.quote(str(sid), safe=""))
