"""Locker's runtime kernel: a Jupyter kernel in front of a language runtime process.

The code driver (driver.py) starts this file as `python3 -c SOURCE -f CONNECTION_FILE` for
the languages Locker carries its own runtime for (JavaScript and TypeScript on Node,
`js_runtime.js`; Java on JShell, `JShellRuntime.java`), with the runtime described in the
environment variable LOCKER_KERNEL_RUNTIME (JSON in base64, removed before the runtime starts):

    {"language_info": {...}, "argv": ["node", "{source}", ...],
     "source": "<the runtime's source>", "filename": "js_runtime.js"}

It owns the Jupyter side (ipykernel's messaging, execution counts, interrupts) and the
runtime's process; it knows no language. The runtime's source is written to a private
directory (0700) only until the runtime says it is ready, then removed: nothing of it stays
on the machine's disk.

The runtime protocol (both sides):
- the runtime's fd 0 is /dev/null; fd 1 and fd 2 are pipes read here and published raw as
  the running cell's stdout and stderr (a child process's output included);
- fd 3 carries requests, one JSON object per line: {"id", "code", "silent"}, one at a time;
- fd 4 carries events, one JSON object per line: {"ready": true, ...} once at start, then
  for each request any number of {"id", "stream": "stdout"|"stderr", "text"} and
  {"id", "display": {mime: data}}, and one {"id", "done": true, "result": bundle|null,
  "error": null|{"ename", "evalue", "traceback": [...]}};
- an interrupt is SIGINT to the runtime (sent here: the driver signals only the kernel's
  process): the running cell ends with an error and state is kept;
- the end of fd 3 ends the runtime; it also dies with this kernel (`setpriv --pdeathsig`,
  and the kernel's process group, which jupyter_client kills whole).

A runtime that exits is reported to the cell that was running (or the next one) as an
error, and this kernel exits with it, so that the driver starts a new one (the state is
gone either way).
"""

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile

from ipykernel.kernelbase import Kernel

SPEC = json.loads(base64.b64decode(os.environ.pop("LOCKER_KERNEL_RUNTIME", "")) or b"{}")
# How much of a pipe one read takes.
READ_SIZE = 1 << 16


class RuntimeExited(Exception):
    pass


class Runtime:
    """The runtime process and the three pipes it is read through."""

    def __init__(self, spec):
        self.dir = tempfile.mkdtemp(prefix="locker-kernel-")
        path = os.path.join(self.dir, spec["filename"])
        with open(path, "w", encoding="utf-8") as f:
            f.write(spec["source"])
        argv = [a.replace("{source}", path) for a in spec["argv"]]
        if shutil.which("setpriv"):
            # Killed when this kernel dies, even by SIGKILL (the driver's last resort).
            argv = ["setpriv", "--pdeathsig", "KILL", "--"] + argv
        # Numbered from 10 up, so that putting them at 3 and 4 in the child clobbers neither.
        req_r, req_w = os.pipe()
        ev_r, ev_w = os.pipe()
        self.req_w = req_w
        self.ev_r = ev_r
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (req_r, ev_w)]
        os.close(req_r)
        os.close(ev_w)

        def child_setup():
            # Only dup2: nothing that takes a lock another thread may hold at the fork.
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        # ipykernel ignores SIGINT between requests, and an ignored signal stays ignored
        # across exec: a JVM would then never see an interrupt. A handler of ours instead
        # becomes the default in the runtime.
        saved = signal.signal(signal.SIGINT, lambda *_: None)
        try:
            # In the kernel's process group: the driver's kills reach it with the kernel.
            # Every descriptor here is close-on-exec but the three pipes and 3 and 4.
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                close_fds=False,
                preexec_fn=child_setup,
            )
        except OSError as e:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise RuntimeError("%s could not be started: %s" % (argv[0], e))
        finally:
            signal.signal(signal.SIGINT, saved)
            for fd in high:
                os.close(fd)
        self.out = {self.proc.stdout.fileno(): "stdout", self.proc.stderr.fileno(): "stderr"}
        for fd in list(self.out) + [self.ev_r]:
            os.set_blocking(fd, False)
        self.partial = b""
        self.events = []
        self.ready = None

    def forget_source(self):
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def send(self, request):
        data = (json.dumps(request) + "\n").encode()
        while data:
            try:
                n = os.write(self.req_w, data)
            except BlockingIOError:
                select.select([], [self.req_w], [])
                continue
            except BrokenPipeError:
                raise RuntimeExited()
            data = data[n:]

    def drain(self, fd, emit):
        """Reads what `fd` holds now; False at its end."""
        while True:
            try:
                chunk = os.read(fd, READ_SIZE)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            emit(self.out[fd], chunk)

    def read_events(self):
        """Reads what the event pipe holds now into `events`; False at its end."""
        while True:
            try:
                chunk = os.read(self.ev_r, READ_SIZE)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            lines = (self.partial + chunk).split(b"\n")
            self.partial = lines.pop()
            for line in lines:
                if line.strip():
                    try:
                        self.events.append(json.loads(line))
                    except ValueError:
                        pass  # not the protocol's: ignored, the runtime's own fault

    def wait(self, emit, until):
        """Reads the three pipes, streaming output through `emit(name, bytes)`, until
        `until(event)` says an event is the one awaited; returns it. RuntimeExited when the
        runtime's event pipe ends first."""
        while True:
            while self.events:
                event = self.events.pop(0)
                if until(event):
                    # Output written before the event is in the pipes by now.
                    for fd in self.out:
                        self.drain(fd, emit)
                    return event
                emit_event(event, emit)
            fds = list(self.out) + [self.ev_r]
            readable, _, _ = select.select(fds, [], [])
            for fd in readable:
                if fd == self.ev_r:
                    if not self.read_events() and not self.events:
                        for out in list(self.out):
                            self.drain(out, emit)
                        raise RuntimeExited()
                elif not self.drain(fd, emit):
                    del self.out[fd]

    def status(self):
        """How the runtime ended, in words (after RuntimeExited)."""
        try:
            code = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return "closed its event pipe"
        if code < 0:
            return "was killed by signal %d" % -code
        return "exited with status %d" % code

    def interrupt(self):
        try:
            os.kill(self.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    def close(self):
        self.forget_source()
        try:
            os.close(self.req_w)
        except OSError:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def emit_event(event, emit):
    """An event that is not the awaited one: streamed output or a display."""
    if "stream" in event:
        emit(event["stream"], event.get("text", ""))
    elif "display" in event:
        emit("display", event["display"])


class RuntimeKernel(Kernel):
    implementation = "locker-runtime"
    implementation_version = "1"
    language_info = SPEC.get("language_info", {"name": "unknown"})
    banner = "Locker's %s kernel" % language_info.get("name", "")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.next_id = 0
        self.runtime = None
        self.start_runtime()

    def start_runtime(self):
        """A new runtime (the state of the last one, if any, is gone); started now, so that
        its start-up overlaps the wait for the first cell."""
        self.runtime, self.start_error = None, None
        try:
            self.runtime = Runtime(SPEC)
        except Exception as e:  # said to the cells
            self.start_error = str(e)

    def publish(self, silent):
        decoder = {}

        def emit(name, data):
            if silent:
                return
            if name == "display":
                self.send_response(
                    self.iopub_socket, "display_data", {"data": data, "metadata": {}}
                )
                return
            if isinstance(data, bytes):
                # A multi-byte character cut between two reads is joined with the next.
                data = decoder.setdefault(name, _decoder())(data)
                if not data:
                    return
            self.send_response(self.iopub_socket, "stream", {"name": name, "text": data})

        return emit

    def fail(self, ename, evalue, traceback, silent):
        if not silent:
            self.send_response(
                self.iopub_socket,
                "error",
                {"ename": ename, "evalue": evalue, "traceback": traceback},
            )
        return {
            "status": "error",
            "execution_count": self.execution_count,
            "ename": ename,
            "evalue": evalue,
            "traceback": traceback,
        }

    def do_execute(self, code, silent, store_history=True, user_expressions=None,
                   allow_stdin=False):
        if self.runtime is None:
            self.start_runtime()
        if self.start_error:
            return self.fail("KernelError", self.start_error, [self.start_error], silent)
        runtime = self.runtime
        emit = self.publish(silent)
        try:
            if runtime.ready is None:
                runtime.ready = self.guarded(runtime, emit, lambda e: e.get("ready"))
                runtime.forget_source()
                if runtime.ready.get("error"):
                    raise RuntimeExited()
            self.next_id += 1
            rid = self.next_id
            runtime.send({"id": rid, "code": code, "silent": bool(silent)})
            done = self.guarded(
                runtime, emit, lambda e: e.get("id") == rid and e.get("done")
            )
        except RuntimeExited:
            why = (runtime.ready or {}).get("error") or "the %s runtime %s" % (
                self.language_info.get("name"),
                runtime.status(),
            )
            runtime.close()
            # The next cell starts a new runtime, with empty state.
            self.runtime = None
            why += "; its state is lost, the next cell starts a new one"
            return self.fail("RuntimeExited", why, [why], silent)
        error = done.get("error")
        if error:
            return self.fail(
                str(error.get("ename", "Error")),
                str(error.get("evalue", "")),
                [str(line) for line in error.get("traceback") or []],
                silent,
            )
        result = done.get("result")
        if result and not silent:
            self.send_response(
                self.iopub_socket,
                "execute_result",
                {"data": result, "metadata": {}, "execution_count": self.execution_count},
            )
        return {
            "status": "ok",
            "execution_count": self.execution_count,
            "payload": [],
            "user_expressions": {},
        }

    def guarded(self, runtime, emit, until):
        """runtime.wait, with SIGINT (the driver's interrupt) forwarded to the runtime."""
        while True:
            try:
                return runtime.wait(emit, until)
            except KeyboardInterrupt:
                runtime.interrupt()

    def do_shutdown(self, restart):
        if self.runtime is not None:
            self.runtime.close()
        return {"status": "ok", "restart": restart}

    def do_is_complete(self, code):
        return {"status": "unknown"}


def _decoder():
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return lambda data: dec.decode(data)


if __name__ == "__main__":
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(kernel_class=RuntimeKernel)
