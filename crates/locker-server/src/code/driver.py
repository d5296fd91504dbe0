"""Locker's code-context driver: Jupyter kernels inside one machine, on jupyter_client.

The locker server ships this file inside its binary and starts it on a sandbox's first code
call as `python3 - --start` (the source on stdin, after `KERNEL_FILES = {...}`: Locker's kernels).
The starting process checks that jupyter_client and ipykernel import, forks the driver
(its own session, output to /var/tmp/locker/code-driver.log), waits until it listens on
127.0.0.1:PORT and exits: 0 started (or one already runs), 3 the template has no Jupyter
kernel, 4 the port is taken or the driver failed to start.

The driver answers small HTTP/1.0 requests from the server (on the machine's loopback: a
jail's dialled by the host in its network namespace, a microVM's through the agent's port
tunnel; never from the network): contexts (create, list, restart, interrupt, delete) and
executions, streamed as NDJSON in the API contract's shapes. Each context is one kernel
(jupyter_client's KernelManager and BlockingKernelClient, the Jupyter messaging protocol)
owned by one worker thread, which runs the context's jobs one at a time in arrival order:
that is the queue of concurrent calls on one context. Interrupts are SIGINT to the kernel
(ipykernel's interrupt mode); a timeout interrupts, then restarts a kernel that does not
stop within INTERRUPT_GRACE_S (1 s for an installed Deno kernel: it ignores SIGINT). A kernel
that dies is reported (`context_died`) and the next job on its context starts a fresh one.

Kernels are found by kernelspec name first (KERNELS: `python3` ipykernel, `ir` IRkernel, a
`javascript` one such as Deno's, a `bash` one such as bash_kernel): a kernel the template
installs is the one used. Where none is installed, Locker's own kernels serve (`kernels/`
beside this file, sent with it as KERNEL_FILES, started without a file of their own): bash
(`bash_kernel.py`), JavaScript and TypeScript on the sandbox's `node` (`js_runtime.js`),
Java on its JDK's JShell (`JShellRuntime.java`), the last two behind `runtime_kernel.py`.

A spare kernel (`POST /spare`, asked by the server's warm pool before the machine is a
sandbox's) is a Python kernel started ahead of any context: the first Python context
created (the default one of a cell without `context`, or `POST /contexts`) takes it, moved to
its working directory and given its environment, instead of paying a kernel's start-up. No
new spare is started after it is taken, so a sandbox keeps no idle kernel of its own.

What user code does to this process (kill it, flood it) is contained by the server: every
line it sends back is parsed and capped there, and a driver that is gone is started again.
"""

import base64
import json
import os
import queue
import re
import shutil
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = 49999
LOG = "/var/tmp/locker/code-driver.log"
# After an interrupt, a kernel that sends nothing for this long is deemed stuck (native
# code that ignores SIGINT), and one still sending after INTERRUPT_LIMIT_S (a flood it
# keeps printing) too: both are restarted.
INTERRUPT_GRACE_S = 15.0
INTERRUPT_LIMIT_S = 60.0
KERNEL_READY_S = 60.0
# A single result MIME value larger than this is dropped (its text/plain is capped at the
# call's max_output_bytes instead, head and tail kept).
RESULT_VALUE_CAP = 8 << 20
# All results of one execution together.
RESULTS_CAP = 32 << 20
# The kernelspec names tried for each language, in order.
KERNELS = {
    "python": ["python3"],
    "javascript": ["javascript"],
    "typescript": ["typescript"],
    "bash": ["bash"],
    "r": ["ir", "r"],
    "java": ["java"],
}
# Locker's own kernels' sources, by file name (the server puts them before this source).
try:
    KERNEL_FILES
except NameError:
    KERNEL_FILES = {}
# How a kernel given as source is started: the source is the argument after `-c`'s, in
# base64 (jupyter_client substitutes `{name}` and `${NAME}` in a kernelspec's argv and env).
KERNEL_LAUNCH = (
    "import base64,sys;"
    "exec(compile(base64.b64decode(sys.argv.pop(1)),'<locker kernel>','exec'))"
)
# The JVM's options for JShell: one JVM (JShell's local engine), quick start before peak speed.
JAVA_OPTIONS = [
    "-XX:TieredStopAtLevel=1",
    "-XX:+UseSerialGC",
    "-Xshare:auto",
    "-Dfile.encoding=UTF-8",
    "-Dstdout.encoding=UTF-8",
    "-Dstderr.encoding=UTF-8",
]
# Where an installed kernel of a language departs from ipykernel's behaviour (Locker's own
# kernels do not), and what the driver does
# about it (a language not named here behaves as ipykernel does):
# - `grace`: seconds without output after an interrupt before the kernel is restarted
#   (INTERRUPT_GRACE_S otherwise). Deno's kernel does not stop a running cell on SIGINT (an
#   endless loop or a pending `await` alike): waiting longer would only delay its restart.
# - `late`: seconds a cell still listens for its own outputs after the kernel said it was
#   idle and replied. Deno's kernel publishes from more than one task and now and then sends
#   a cell's execute_result after its idle status (15 ms was enough on a quiet host; a CI
#   run on a busy one saw a result come later: 50 ms, paid by Deno's cells only).
# - `env`: defaults for the kernel's environment. Deno colours its text/plain results with
#   ANSI escapes unless told not to.
KERNEL_QUIRKS = {
    "javascript": {"grace": 1.0, "late": 0.05, "env": {"NO_COLOR": "1"}},
}
# How a sandbox gets each kernel (said when it has none).
KERNEL_HINTS = {
    "python": "install python3-ipykernel",
    "javascript": "install Node.js (Debian's nodejs) for Locker's own JavaScript kernel, or a "
    "Jupyter kernel whose kernelspec is named 'javascript' (Deno's: deno jupyter --install "
    "--name javascript)",
    "typescript": "install Node.js and the TypeScript compiler (Debian's nodejs and "
    "node-typescript) for Locker's own TypeScript kernel",
    "bash": "install bash",
    "r": "install IRkernel (Debian's r-cran-irkernel)",
    "java": "install a JDK with JShell (Debian's openjdk-17-jdk-headless) for Locker's own "
    "Java kernel",
}
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    # Locker's display extensions (kernels/python_display.py), E2B's MIME types.
    "e2b/chart": "chart",
    "e2b/data": "data",
}
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Run silently in every new kernel: ipykernel buffers a cell's output without bound until
# its IO thread sends it (every 0.2 s), so a print loop can grow the kernel by hundreds of
# MB before an interrupt lands. Past 1 MiB buffered, a write waits for the send: the
# kernel's memory stays bounded and SIGINT is seen at once.
OUTPUT_BACKPRESSURE = """
def __locker_backpressure():
    import sys
    for s in (sys.stdout, sys.stderr):
        if getattr(s, "_locker_backpressure", False) or not hasattr(s, "_buffer"):
            continue
        def write(text, _s=s, _write=s.write):
            n = _write(text)
            try:
                if _s._buffer.tell() > (1 << 20):
                    _s.flush()
            except Exception:
                pass
            return n
        s.write = write
        s._locker_backpressure = True
__locker_backpressure()
del __locker_backpressure
"""


def now_rfc3339():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ApiError(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


class Capture:
    """One output stream, capped like exec: the head and the tail are kept."""

    def __init__(self, cap):
        self.cap = cap
        self.head = []
        self.head_len = 0
        self.tail = []
        self.tail_len = 0
        self.total = 0

    def add(self, text):
        """Adds text; returns what of it may still be streamed (the head part)."""
        raw = text.encode("utf-8", "replace")
        self.total += len(raw)
        half = self.cap // 2
        room = half - self.head_len
        streamed = b""
        if room > 0:
            streamed = raw[:room]
            self.head.append(streamed)
            self.head_len += len(streamed)
            raw = raw[len(streamed):]
        if raw:
            self.tail.append(raw[-half:] if half else b"")
            self.tail_len += len(self.tail[-1])
            while self.tail_len - len(self.tail[0]) >= half and len(self.tail) > 1:
                self.tail_len -= len(self.tail.pop(0))
        return streamed.decode("utf-8", "ignore")

    def truncated(self):
        return self.total > self.head_len + min(self.tail_len, self.cap // 2)

    def text(self):
        head = b"".join(self.head)
        tail = b"".join(self.tail)
        half = self.cap // 2
        if len(tail) > half:
            tail = tail[len(tail) - half:]
        kept = len(head) + len(tail)
        if self.total <= kept:
            return (head + tail).decode("utf-8", "replace")
        return "%s\n…[locker: %d bytes omitted]…\n%s" % (
            head.decode("utf-8", "ignore"),
            self.total - kept,
            tail.decode("utf-8", "ignore"),
        )


def head_and_tail(text, cap):
    """`text` within `cap` bytes: its head and its tail kept, what was cut said between."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= cap:
        return text, False
    half = cap // 2
    return "%s\n…[locker: %d bytes omitted]…\n%s" % (
        raw[:half].decode("utf-8", "ignore"),
        len(raw) - 2 * half,
        raw[len(raw) - half:].decode("utf-8", "ignore"),
    ), True


def result_of(data, is_main, budget, text_cap):
    """A Jupyter MIME bundle as the contract's Result, within `budget` bytes. Its text/plain
    is capped like a stream (`text_cap`, head and tail kept); a larger value of another type
    is left out (`truncated`), since half an image or half a page is no use."""
    out = {"is_main_result": is_main}
    size = 0
    for mime, field in MIME_FIELDS.items():
        if mime not in data:
            continue
        value = data[mime]
        if isinstance(value, list) and mime.startswith(("text/", "image/svg")):
            # Jupyter may split a text value into a list of lines.
            value = "".join(value)
        if mime == "text/plain" and isinstance(value, str):
            value, cut = head_and_tail(value, min(text_cap, budget))
            if cut:
                out["truncated"] = True
        n = len(value) if isinstance(value, str) else len(json.dumps(value))
        if n > RESULT_VALUE_CAP or size + n > budget:
            out["truncated"] = True
            continue
        out[field] = value
        size += n
    extra = sorted(m for m in data if m not in MIME_FIELDS)
    if extra:
        out["other_types"] = extra
    return out, size


class Job:
    def __init__(self, kind, **kw):
        self.kind = kind
        self.kw = kw
        self.events = queue.Queue()
        self.cancelled = False


def kernel_manager(language):
    """A KernelManager for `language` and whether its kernel is one the sandbox installed
    (else Locker's own); NoSuchKernel when there is neither."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    installed = KernelSpecManager()
    for name in KERNELS[language]:
        try:
            installed.get_kernel_spec(name)
        except NoSuchKernel:
            continue
        return KernelManager(kernel_name=name, kernel_spec_manager=installed), True
    spec = own_kernel(language)
    if spec is None:
        raise NoSuchKernel(KERNELS[language][0])

    class Own(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return spec

    return KernelManager(kernel_name="locker-" + language, kernel_spec_manager=Own()), False


def b64(text):
    return base64.b64encode(text.encode()).decode()


def own_kernel(language):
    """Locker's own kernel for `language` as a KernelSpec, or None where this sandbox lacks
    what it runs on (bash, node, a JDK with JShell)."""
    from jupyter_client.kernelspec import KernelSpec

    runtime = None
    if language == "bash":
        if not shutil.which("bash"):
            return None
        source = KERNEL_FILES["bash_kernel.py"]
    elif language in ("javascript", "typescript"):
        node = shutil.which("node") or shutil.which("nodejs")
        if not node:
            return None
        ts = language == "typescript"
        runtime = {
            "argv": [node, "{source}"] + (["--typescript"] if ts else []),
            "filename": "js_runtime.cjs",
            "source": KERNEL_FILES["js_runtime.js"],
            "language_info": {
                "name": language,
                "file_extension": ".ts" if ts else ".js",
                "mimetype": "text/typescript" if ts else "text/javascript",
            },
        }
    elif language == "java":
        java = shutil.which("java")
        if not java or not shutil.which("jshell"):
            return None
        runtime = {
            "argv": [java] + JAVA_OPTIONS + java_memory() + ["--source", "17", "{source}"],
            "filename": "JShellRuntime.java",
            "source": KERNEL_FILES["JShellRuntime.java"],
            "language_info": {
                "name": "java",
                "file_extension": ".jshell",
                "mimetype": "text/x-java-source",
            },
        }
    else:
        return None
    env = {}
    if runtime is not None:
        source = KERNEL_FILES["runtime_kernel.py"]
        env["LOCKER_KERNEL_RUNTIME"] = b64(json.dumps(runtime))
    return KernelSpec(
        argv=[sys.executable, "-c", KERNEL_LAUNCH, b64(source), "-f", "{connection_file}"],
        display_name="Locker " + language,
        language=language,
        interrupt_mode="signal",
        env=env,
    )


def java_memory():
    """The JVM sizes its heap from the memory it believes the machine has (a quarter): in a
    jail that is the host's, unless told the machine's, which /proc/meminfo says here."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return ["-XX:MaxRAM=%dk" % int(line.split()[1])]
    except (OSError, ValueError, IndexError):
        pass
    return []


class Context:
    """One kernel and the worker thread that owns it."""

    def __init__(self, cid, language, cwd, env):
        self.id = cid
        self.language = language
        # Set when the kernel starts: an installed kernel's departures (KERNEL_QUIRKS).
        self.quirks = {}
        self.cwd = cwd
        self.env = env
        self.created_at = now_rfc3339()
        self.km = None
        self.kc = None
        self.jobs = queue.Queue()
        self.busy = False
        self.restarting = False
        self.interrupt_asked = False
        self.closed = False
        self.last_error = None
        threading.Thread(target=self.work, daemon=True).start()

    def describe(self):
        return {
            "id": self.id,
            "language": self.language,
            "cwd": self.cwd,
            "created_at": self.created_at,
        }

    def submit(self, job):
        if self.closed:
            raise ApiError(404, "context %s was deleted" % self.id)
        self.jobs.put(job)
        return job

    def kernel_pid(self):
        try:
            return self.km.provisioner.process.pid
        except AttributeError:
            return None

    def signal_kernel(self, sig):
        pid = self.kernel_pid()
        if pid:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def alive(self):
        return self.km is not None and self.km.is_alive()

    # The worker thread: the only one that touches km and kc.
    def work(self):
        while True:
            job = self.jobs.get()
            try:
                if job.kind == "start":
                    self.start()
                    job.events.put(("done", self.describe()))
                elif job.kind == "adopt":
                    self.adopt()
                    job.events.put(("done", self.describe()))
                elif job.kind == "execute":
                    self.busy = True
                    try:
                        self.execute(job)
                    finally:
                        self.busy = False
                elif job.kind == "restart":
                    self.stop()
                    self.start()
                    self.restarting = False
                    job.events.put(("done", self.describe()))
                elif job.kind == "delete":
                    self.stop()
                    job.events.put(("done", {}))
                    return
            except ApiError as e:
                job.events.put(("fail", e))
            except Exception as e:  # the kernel's own failure, said as it is
                job.events.put(("fail", ApiError(500, "%s: %s" % (type(e).__name__, e))))

    def start(self):
        from jupyter_client.kernelspec import NoSuchKernel

        env = dict(os.environ)
        env.update(self.env)
        env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        # ipykernel's debugger warns on every start that Python's modules are frozen.
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        env.pop("LOCKER_CODE_DRIVER", None)
        if not os.path.isdir(self.cwd):
            raise ApiError(400, "cwd %s is not a directory in the sandbox" % self.cwd)
        try:
            km, installed = kernel_manager(self.language)
            self.quirks = KERNEL_QUIRKS.get(self.language, {}) if installed else {}
            for k, v in self.quirks.get("env", {}).items():
                env.setdefault(k, v)
            km.start_kernel(cwd=self.cwd, env=env)
        except NoSuchKernel:
            raise ApiError(
                400,
                "no %s kernel in this sandbox (no kernelspec %s, and not what Locker's own "
                "kernel needs): %s"
                % (
                    self.language,
                    " or ".join(repr(n) for n in KERNELS[self.language]),
                    KERNEL_HINTS[self.language],
                ),
            )
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=KERNEL_READY_S)
        except RuntimeError as e:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
            raise ApiError(500, "the kernel did not start: %s" % e)
        self.km, self.kc = km, kc
        if self.language == "python":
            self.run_silent(OUTPUT_BACKPRESSURE)
            if installed and "python_display.py" in KERNEL_FILES:
                self.run_silent(KERNEL_FILES["python_display.py"])

    def adopt(self):
        """Makes a spare kernel this context's: its working directory and environment."""
        if not os.path.isdir(self.cwd):
            raise ApiError(400, "cwd %s is not a directory in the sandbox" % self.cwd)
        if not self.alive():
            self.stop()
            self.start()
            return
        self.run_silent(
            "import os as __locker_os\n"
            "__locker_os.chdir(%r)\n"
            "__locker_os.environ.update(%r)\n"
            "del __locker_os\n" % (self.cwd, dict(self.env))
        )

    def stop(self):
        if self.kc is not None:
            self.kc.stop_channels()
        if self.km is not None:
            try:
                self.km.shutdown_kernel(now=True)
            except Exception:
                self.signal_kernel(signal.SIGKILL)
        self.km, self.kc = None, None

    def not_run(self, kw, started):
        """A cell whose timeout passed while it waited behind earlier cells."""
        return {
            "type": "execution",
            "execution_count": None,
            "stdout": "",
            "stderr": "",
            "results": [],
            "error": {
                "name": "TimeoutError",
                "value": "timeout_ms=%d passed while the cell waited behind earlier cells of "
                "context %s; it did not run" % (kw["timeout_ms"], self.id),
                "traceback": "",
            },
            "reason": "timeout",
            "context": self.id,
            "timings": {"run_ms": 0.0},
        }

    def execute(self, job):
        emit = job.events.put
        kw = job.kw
        started = time.monotonic()
        deadline = kw["submitted"] + kw["timeout_ms"] / 1000.0
        if started >= deadline:
            emit(("end", self.not_run(kw, started)))
            return
        if not self.alive():
            self.stop()
            self.start()
        cap = kw["max_output_bytes"]
        out = {"stdout": Capture(cap), "stderr": Capture(cap)}
        env = kw.get("env") or {}
        setup, restore = env_code(self.language, env)
        if env:
            self.run_silent(setup)
        try:
            self.run_cell(job, kw, started, deadline, out, emit)
        finally:
            if env and self.alive():
                self.run_silent(restore)

    def run_silent(self, code):
        """Runs bookkeeping code that shows nothing and counts no execution."""
        msg_id = self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        until = time.monotonic() + 10.0
        while time.monotonic() < until:
            try:
                reply = self.kc.get_shell_msg(timeout=0.5)
            except queue.Empty:
                if not self.alive():
                    return
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                return

    def run_cell(self, job, kw, started, deadline, out, emit):
        self.interrupt_asked = False
        results, results_size = [], 0
        error = None
        count = None
        reason = "finished"

        def take(msg):
            """One output message of this cell: a stream, a result, an error, its input."""
            nonlocal results_size, error, count
            kind = msg["msg_type"]
            content = msg["content"]
            if kind == "stream":
                name = "stderr" if content.get("name") == "stderr" else "stdout"
                shown = out[name].add(content.get("text", ""))
                if shown and kw["stream"]:
                    emit(("line", {"type": name, "text": shown}))
            elif kind in ("execute_result", "display_data"):
                r, n = result_of(
                    content.get("data", {}),
                    kind == "execute_result",
                    RESULTS_CAP - results_size,
                    kw["max_output_bytes"],
                )
                results_size += n
                results.append(r)
                if kw["stream"]:
                    line = dict(r)
                    line["type"] = "result"
                    emit(("line", line))
            elif kind == "error":
                error = {
                    "name": content.get("ename", ""),
                    "value": content.get("evalue", ""),
                    "traceback": ANSI.sub("", "\n".join(content.get("traceback", []))),
                }
                if kw["stream"]:
                    line = dict(error)
                    line["type"] = "error"
                    emit(("line", line))
            elif kind == "execute_input":
                count = content.get("execution_count", count)

        msg_id = self.kc.execute(
            kw["code"], store_history=True, allow_stdin=False, stop_on_error=False
        )
        interrupted_at = None
        progress_at = None
        idle = False
        replied = False
        died = False
        while not (idle and replied):
            now = time.monotonic()
            if job.cancelled and interrupted_at is None:
                self.signal_kernel(signal.SIGINT)
                interrupted_at = progress_at = now
                reason = "interrupted"
            if now >= deadline and interrupted_at is None:
                self.signal_kernel(signal.SIGINT)
                interrupted_at = progress_at = now
                reason = "timeout"
            if interrupted_at is not None and (
                now - progress_at > self.quirks.get("grace", INTERRUPT_GRACE_S)
                or now - interrupted_at > INTERRUPT_LIMIT_S
            ):
                # The kernel ignores SIGINT (stuck in native code): a new kernel, state lost.
                self.stop()
                self.start()
                error = {
                    "name": "KernelRestarted",
                    "value": "the kernel did not stop after its interrupt and was restarted: "
                    "the context's variables are gone",
                    "traceback": "",
                }
                break
            if idle:
                # Only the shell's reply is missing: wait for it there.
                try:
                    reply = self.kc.get_shell_msg(timeout=0.2)
                except queue.Empty:
                    died = not self.alive()
                    if died:
                        break
                    continue
                if reply["parent_header"].get("msg_id") == msg_id:
                    replied = True
                    count = reply["content"].get("execution_count", count)
                continue
            if not replied:
                try:
                    reply = self.kc.get_shell_msg(timeout=0)
                    if reply["parent_header"].get("msg_id") == msg_id:
                        replied = True
                        count = reply["content"].get("execution_count", count)
                except queue.Empty:
                    pass
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                died = not self.alive()
                if died:
                    break
                continue
            progress_at = time.monotonic()
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status":
                idle = msg["content"].get("execution_state") == "idle"
            else:
                take(msg)
        late = self.quirks.get("late")
        if late and not died:
            until = time.monotonic() + late
            while True:
                try:
                    msg = self.kc.get_iopub_msg(timeout=max(until - time.monotonic(), 0))
                except queue.Empty:
                    break
                if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] != "status":
                    take(msg)
        if died:
            reason = "interrupted" if self.restarting else "context_died"
            error = {
                "name": "ContextDied",
                "value": "the kernel exited while running this code (os._exit, a crash, or "
                "killed); the next call on this context starts a new kernel with empty state",
                "traceback": "",
            }
        if reason in ("finished", "error") and self.interrupt_asked:
            reason = "interrupted"
        if reason == "finished" and error is not None:
            reason = "error"
        if reason == "timeout" and error is None:
            error = {
                "name": "TimeoutError",
                "value": "the code ran past timeout_ms=%d and was interrupted; the "
                "context keeps its state" % kw["timeout_ms"],
                "traceback": "",
            }
        execution = {
            "type": "execution",
            "execution_count": count,
            "stdout": out["stdout"].text(),
            "stderr": out["stderr"].text(),
            "stdout_truncated": out["stdout"].truncated(),
            "stderr_truncated": out["stderr"].truncated(),
            "results": results,
            "error": error,
            "reason": reason,
            "context": self.id,
            "timings": {"run_ms": round((time.monotonic() - started) * 1000.0, 3)},
        }
        emit(("end", execution))


def env_code(language, env):
    """The code that sets a cell's own variables in the kernel's environment, keeping what
    they were, and the code that puts them back, in the kernel's language."""
    if language == "python":
        return (
            "import os as __locker_os\n"
            "__locker_saved_env = {k: __locker_os.environ.get(k) for k in %r}\n"
            "__locker_os.environ.update(%r)\n" % (list(env), env),
            PYTHON_ENV_RESTORE,
        )
    if language == "bash":
        bad = [k for k in env if not SHELL_NAME.match(k)]
        if bad:
            raise ApiError(
                400,
                "env names %s are not shell variable names (letters, digits and _, not "
                "starting with a digit): a bash cell cannot set them" % ", ".join(bad),
            )
        setup, restore = [], []
        for k, v in env.items():
            setup.append(
                "__locker_had_%s=${%s+1}; __locker_old_%s=${%s-}; export %s=%s"
                % (k, k, k, k, k, shell_quote(v))
            )
            restore.append(
                'if [ -n "$__locker_had_%s" ]; then export %s="$__locker_old_%s"; '
                "else unset %s; fi; unset __locker_had_%s __locker_old_%s" % ((k,) * 6)
            )
        return "\n".join(setup), "\n".join(restore)
    if not env:
        return "", ""
    if language in ("javascript", "typescript"):
        return (
            "globalThis.__locker_saved_env = Object.fromEntries(%s.map(k => [k, "
            "process.env[k]])); Object.assign(process.env, %s);"
            % (json.dumps(list(env)), json.dumps(env)),
            "for (const [k, v] of Object.entries(globalThis.__locker_saved_env)) { if (v === "
            "undefined) delete process.env[k]; else process.env[k] = v; } "
            "delete globalThis.__locker_saved_env;",
        )
    if language == "java":
        # As E2B's server does: a Java cell's variables are system properties (the process
        # environment cannot change), read with System.getProperty.
        return (
            "java.util.Map<String, String> __locker_saved_env = new java.util.HashMap<>();\n"
            + "".join(
                "__locker_saved_env.put(%s, System.getProperty(%s));\n"
                "System.setProperty(%s, %s);\n" % (java_str(k), java_str(k), java_str(k), java_str(v))
                for k, v in env.items()
            ),
            "__locker_saved_env.forEach((k, v) -> { if (v == null) System.clearProperty(k); "
            "else System.setProperty(k, v); });",
        )
    if language == "r":
        names = "c(%s)" % ", ".join(r_str(k) for k in env)
        return (
            ".locker_saved_env <- Sys.getenv(%s, unset = NA, names = TRUE)\n"
            "do.call(Sys.setenv, as.list(c(%s)))\n"
            % (names, ", ".join("%s = %s" % (r_str(k), r_str(v)) for k, v in env.items())),
            "for (.k in names(.locker_saved_env)) { if (is.na(.locker_saved_env[[.k]])) "
            "Sys.unsetenv(.k) else do.call(Sys.setenv, setNames(list(.locker_saved_env[[.k]]), "
            ".k)) }\nrm(.locker_saved_env, .k)",
        )
    raise ApiError(400, "a %s cell takes no `env`: set it in the context" % language)


def java_str(value):
    """`value` as a Java string literal."""
    out = []
    for ch in value:
        if ch in "\\\"":
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ord(ch) < 0x20 or ord(ch) > 0x7E:
            out.extend("\\u%04x" % u for u in _utf16(ch))
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _utf16(ch):
    data = ch.encode("utf-16-be")
    return [int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2)]


def r_str(value):
    """`value` as an R string literal."""
    out = []
    for ch in value:
        if ch in "\\\"":
            out.append("\\" + ch)
        elif ord(ch) < 0x20:
            out.append("\\x%02x" % ord(ch))
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


SHELL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def shell_quote(value):
    return "'" + value.replace("'", "'\\''") + "'"


PYTHON_ENV_RESTORE = """
for __k, __v in __locker_saved_env.items():
    if __v is None:
        __locker_os.environ.pop(__k, None)
    else:
        __locker_os.environ[__k] = __v
del __locker_saved_env, __locker_os
"""


def home_dir(home):
    """`home` (where a context starts when the request named no cwd: E2B's layer says
    /home/user) if it is a directory here, else None (the driver's own default)."""
    return home if home and os.path.isdir(home) else None


def default_cwd():
    home = os.environ.get("HOME") or "/"
    return home if os.path.isdir(home) else "/"


class Driver:
    def __init__(self):
        self.lock = threading.Lock()
        self.contexts = {}
        # Started kernels waiting for their context, by language (see the module doc).
        self.spares = {}
        # The id of every context ever made here.
        self.made = set()

    def start_spare(self, language):
        """Starts a spare kernel of `language` unless one waits; returns when it is ready."""
        if language != "python":
            raise ApiError(400, "only python kernels are kept spare")
        with self.lock:
            if language in self.spares:
                return
            ctx = Context("spare_" + language, language, default_cwd(), {})
            self.spares[language] = ctx
        outcome, value = wait(ctx.submit(Job("start")))
        if outcome == "fail":
            with self.lock:
                self.spares.pop(language, None)
            ctx.closed = True
            ctx.jobs.put(Job("delete"))
            raise value

    def take_spare(self, cid, language, cwd, env):
        """The spare kernel of `language` as context `cid` (under the lock), if one waits."""
        ctx = self.spares.pop(language, None)
        if ctx is None:
            return None
        ctx.id = cid
        ctx.cwd = cwd
        ctx.env = env
        ctx.created_at = now_rfc3339()
        return ctx

    def get(self, cid):
        with self.lock:
            ctx = self.contexts.get(cid)
        if ctx is None or ctx.closed:
            raise ApiError(
                404,
                "no context %s in this sandbox (contexts live in the machine's memory: they "
                "end when deleted, with the machine, or when the code driver is killed)" % cid,
            )
        return ctx

    def create(self, cid, language, cwd, env):
        if language not in KERNELS:
            raise ApiError(400, "language must be one of %s" % ", ".join(KERNELS))
        if not cwd:
            cwd = default_cwd()
        with self.lock:
            if cid in self.contexts:
                return self.contexts[cid], False
            ctx = self.take_spare(cid, language, cwd, env)
            job = Job("start") if ctx is None else Job("adopt")
            if ctx is None:
                ctx = Context(cid, language, cwd, env)
            self.contexts[cid] = ctx
        outcome, value = wait(ctx.submit(job))
        if outcome == "fail":
            with self.lock:
                self.contexts.pop(cid, None)
            ctx.closed = True
            ctx.jobs.put(Job("delete"))
            raise value
        self.made.add(cid)
        return ctx, True

    def delete(self, cid):
        ctx = self.get(cid)
        with self.lock:
            self.contexts.pop(cid, None)
        ctx.closed = True
        ctx.restarting = True
        ctx.signal_kernel(signal.SIGKILL)
        job = Job("delete")
        ctx.jobs.put(job)
        wait(job)


def wait(job):
    kind, value = job.events.get()
    return kind, value


DRIVER = Driver()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    # An answer is a head and a line or two: Nagle's delay would hold each back ~40 ms.
    disable_nagle_algorithm = True

    def log_message(self, fmt, *args):
        pass

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b"{}"
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(400, "the body is not JSON")

    def answer(self, status, value):
        raw = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def handle_any(self, method):
        try:
            self.route(method, self.path.rstrip("/").split("/")[1:])
        except ApiError as e:
            self.answer(e.status, {"error": e.message})
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self):
        self.handle_any("GET")

    def do_POST(self):
        self.handle_any("POST")

    def do_DELETE(self):
        self.handle_any("DELETE")

    def route(self, method, parts):
        if method == "GET" and parts == ["health"]:
            return self.answer(200, {"ok": True, "pid": os.getpid()})
        if parts == ["contexts"] and method == "GET":
            with DRIVER.lock:
                items = [c.describe() for c in DRIVER.contexts.values() if not c.closed]
            return self.answer(200, {"contexts": items})
        if parts == ["spare"] and method == "POST":
            DRIVER.start_spare(self.body().get("language") or "python")
            return self.answer(200, {"spare": True})
        if parts == ["contexts"] and method == "POST":
            b = self.body()
            cwd = b.get("cwd") or home_dir(b.get("home"))
            if b.get("once") and b["id"] in DRIVER.made:
                # Made before (E2B's default contexts, made by the first list): not again.
                return self.answer(200, {"made_before": True})
            ctx, _ = DRIVER.create(b["id"], b["language"], cwd, b.get("env") or {})
            return self.answer(201, ctx.describe())
        if len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
            DRIVER.delete(parts[1])
            return self.answer(200, {})
        if len(parts) == 3 and parts[0] == "contexts" and method == "POST":
            ctx = DRIVER.get(parts[1])
            if parts[2] == "interrupt":
                if ctx.busy:
                    ctx.interrupt_asked = True
                ctx.signal_kernel(signal.SIGINT)
                return self.answer(200, {"interrupted": ctx.busy})
            if parts[2] == "restart":
                ctx.restarting = True
                ctx.signal_kernel(signal.SIGKILL)
                kind, value = wait(ctx.submit(Job("restart")))
                if kind == "fail":
                    raise value
                return self.answer(200, value)
        if parts == ["execute"] and method == "POST":
            return self.execute(self.body())
        raise ApiError(404, "no route %s %s" % (method, self.path))

    def execute(self, b):
        submitted = time.monotonic()
        cid = b.get("context")
        if cid is None:
            language = b.get("language") or "python"
            cid = "ctx_default_" + language
            ctx, _ = DRIVER.create(cid, language, home_dir(b.get("home")), {})
        else:
            ctx = DRIVER.get(cid)
            if b.get("language") and b["language"] != ctx.language:
                raise ApiError(
                    400,
                    "context %s runs %s, not %s" % (cid, ctx.language, b["language"]),
                )
        job = ctx.submit(
            Job(
                "execute",
                code=b["code"],
                timeout_ms=b["timeout_ms"],
                env=b.get("env") or {},
                max_output_bytes=b["max_output_bytes"],
                stream=b["stream"],
                submitted=submitted,
            )
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.end_headers()
        self.wfile.flush()
        while True:
            kind, value = job.events.get()
            if kind == "fail":
                value = {"type": "failure", "status": value.status, "error": value.message}
                kind = "end"
            try:
                self.wfile.write(json.dumps(value).encode() + b"\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                # The caller went away: stop the code like exec stops a command.
                job.cancelled = True
                ctx.signal_kernel(signal.SIGINT)
                while kind != "end":
                    kind, _ = job.events.get()
                    kind = "end" if kind == "fail" else kind
                return
            if kind == "end":
                return


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def start():
    """Checks the modules, forks the driver and waits until it listens."""
    missing = []
    for mod in ("jupyter_client", "ipykernel"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        sys.stderr.write("missing Python modules: %s\n" % ", ".join(missing))
        return 3
    r, w = os.pipe()
    if os.fork() > 0:
        os.close(w)
        with os.fdopen(r) as f:
            word = f.read().strip()
        if word == "ok":
            return 0
        sys.stderr.write("the code driver did not start: %s\n" % (word or "it died"))
        return 4
    os.close(r)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    os.makedirs(os.path.dirname(LOG), exist_ok=True)
    log = os.open(LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        server = Server(("127.0.0.1", PORT), Handler)
    except OSError as e:
        os.write(w, ("port %d: %s" % (PORT, e.strerror)).encode())
        os._exit(1)
    os.write(w, b"ok")
    os.close(w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    if "--start" in sys.argv:
        sys.exit(start())
    sys.stderr.write("run by the locker server as `python3 - --start`\n")
    sys.exit(2)
