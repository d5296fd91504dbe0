"""Templates of your own (`client.templates`): build one from a Dockerfile and a context
directory, from a template or an image with run steps, or from Debian packages; follow the
build's log; list, read and delete templates; import an image archive.

Owns no transport: the client's `request` and `_ndjson` make the calls.
"""

from __future__ import annotations

import io
import os
import tarfile
import urllib.parse
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

__all__ = ["Templates", "BuildFailed"]


class BuildFailed(Exception):
    """A template build that ended `failed`: `build_id`, `error`, and the `log` lines seen."""

    def __init__(self, build_id: str, error: str, log: List[str]):
        super().__init__(f"template build {build_id} failed: {error}")
        self.build_id = build_id
        self.error = error
        self.log = log


def _context_tar(context: Union[str, os.PathLike, bytes]) -> bytes:
    """A directory as a tar archive (symlinks kept as symlinks), or tar bytes as they are."""
    if isinstance(context, (bytes, bytearray)):
        return bytes(context)
    root = os.fspath(context)
    if not os.path.isdir(root):
        raise ValueError(f"the build context {root!r} is not a directory")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name in sorted(os.listdir(root)):
            t.add(os.path.join(root, name), arcname=name, recursive=True)
    return buf.getvalue()


class Templates:
    """The tenant's templates and builds (`client.templates`)."""

    def __init__(self, client: Any):
        self._c = client

    def list(self) -> List[Dict[str, Any]]:
        """Your templates and the shared `default` and `code-interpreter`."""
        return self._c.request("GET", "/v1/templates")["templates"]

    def get(self, name: str) -> Dict[str, Any]:
        """One template: digest, size, and what sandboxes from it get (env, workdir, user,
        start_cmd, ready_cmd, exposed_ports, labels)."""
        return self._c.request("GET", "/v1/templates/" + urllib.parse.quote(name, safe=""))

    def delete(self, name: str) -> None:
        """Removes a template (409 while a sandbox or snapshot uses it)."""
        self._c.request("DELETE", "/v1/templates/" + urllib.parse.quote(name, safe=""))

    def import_image(self, name: str, archive: Union[str, os.PathLike, bytes, BinaryIO]) -> Dict[str, Any]:
        """Imports an image archive as template `name` (tenant `default` only): the tar
        `docker save` writes or an OCI archive, given as a path, bytes, or a binary file
        (streamed). Returns the template with the image's run config under `config`."""
        path = "/v1/templates/" + urllib.parse.quote(name, safe="") + "/image"
        if isinstance(archive, (str, os.PathLike)):
            with open(archive, "rb") as f:
                return self._c.request("PUT", path, f, timeout=3600)
        return self._c.request("PUT", path, archive, timeout=3600)

    def upload_context(self, context: Union[str, os.PathLike, bytes]) -> str:
        """Uploads a build context (a directory, or tar bytes) and returns its `context_id`."""
        return self._c.request("POST", "/v1/templates/contexts", _context_tar(context))["context_id"]

    def build(
        self,
        name: str,
        *,
        dockerfile: Optional[str] = None,
        context: Union[None, str, os.PathLike, bytes] = None,
        build_args: Optional[Mapping[str, str]] = None,
        template: Optional[str] = None,
        image: Optional[str] = None,
        auth: Optional[Mapping[str, str]] = None,
        packages: Optional[Sequence[str]] = None,
        run: Optional[Sequence[str]] = None,
        follow: bool = True,
        on_event: Optional[Callable[[Dict[str, Any]], None]] = None,
        **options: Any,
    ) -> Union[Dict[str, Any], str]:
        """Builds template `name` from one source: `dockerfile` (its text; `context` a
        directory or tar bytes for its COPY lines; `build_args` for its ARGs), `template`
        or `image` (with `auth`) plus `packages`/`run`, or `packages`/`run` alone (Debian
        bookworm). Other options: env, workdir, user, start_cmd, ready_cmd, network.

        With `follow` (the default) waits for the end, passing each event (log, progress)
        to `on_event`, and returns the template (raises BuildFailed); else returns the
        build id at once."""
        body: Dict[str, Any] = {"name": name}
        sources = [s for s in (dockerfile, template, image) if s is not None]
        if len(sources) > 1:
            raise ValueError("give one of dockerfile, template or image")
        if dockerfile is not None:
            src: Dict[str, Any] = {"dockerfile": dockerfile}
            if context is not None:
                src["context_id"] = self.upload_context(context)
            body["from"] = src
        elif template is not None:
            body["from"] = {"template": template}
        elif image is not None:
            body["from"] = {"image": image, **({"auth": dict(auth)} if auth else {})}
        if context is not None and dockerfile is None:
            raise ValueError("`context` goes with `dockerfile`")
        if packages:
            body["packages"] = list(packages)
        if run:
            body["run"] = list(run)
        if build_args:
            body["build_args"] = dict(build_args)
        body.update({k: v for k, v in options.items() if v is not None})
        build_id = self._c.request("POST", "/v1/templates", body)["build_id"]
        if not follow:
            return build_id
        return self.wait(build_id, on_event=on_event)

    def build_status(self, build_id: str) -> Dict[str, Any]:
        """A build's state, error, template and last log lines."""
        return self._c.request("GET", "/v1/templates/builds/" + urllib.parse.quote(build_id, safe=""))

    def follow(self, build_id: str) -> Iterator[Dict[str, Any]]:
        """A build's events from its first: `log`, `progress`, and last `result`."""
        path = "/v1/templates/builds/" + urllib.parse.quote(build_id, safe="") + "?follow=true"
        return self._c._ndjson("GET", path, timeout=24 * 3600)

    def wait(self, build_id: str, on_event: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
        """Follows a build to its end; the template, or BuildFailed."""
        log: List[str] = []
        for ev in self.follow(build_id):
            if ev.get("type") == "log":
                log.append(ev.get("line", ""))
            if on_event is not None and ev.get("type") != "result":
                on_event(ev)
            if ev.get("type") == "result":
                if ev.get("state") == "succeeded":
                    return ev["template"]
                raise BuildFailed(build_id, str(ev.get("error", "")), log)
        raise BuildFailed(build_id, "the stream ended without a result", log)
