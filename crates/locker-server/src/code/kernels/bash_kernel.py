"""Locker's Jupyter kernel for bash: one persistent interactive bash on a pty per kernel.

Locker's code driver starts it without any file on disk, from a kernelspec whose argv is
`python3 -c <this source> -f {connection_file}` (`interrupt_mode` `signal`); it also runs
as `python3 bash_kernel.py -f CONN`. It needs only the standard library and ipykernel
(Debian's python3-ipykernel): sandboxes cannot install PyPI's bash_kernel, so Locker ships
this one, written for the same observable behaviour.

What it owns:
- One bash (`bash --noprofile --norc --noediting -i`) on a pty of its own, in a session of
  its own with job control, started with the kernel's working directory and environment
  (plus TERM=dumb, PAGER=cat) and a private temp dir (mkdtemp, 0700). Echo and output
  newline translation are off on the pty, history is off, PS2 and PS0 are empty and PS1
  is a marker with a per-kernel random token and `$?`: `[locker-<token>:<status>]`.
  Variables, functions, aliases, `cd` and `export`s persist across cells.
- Running a cell: the code is written to `cell.sh` in the temp dir and the kernel types
  one line on the pty, ` . <dir>/cell.sh </dev/null`, so that the cell runs as one unit in
  the shell itself (multi-line constructs and heredocs work, aliases defined on one line
  work on the next, only one prompt ends it) and whatever reads stdin gets EOF at once.
  Everything bash writes on the pty until the marker is the cell's output: stdout and
  stderr merged (a pty has one stream), decoded as UTF-8, `\\r\\n` turned into `\\n`,
  published as `stream` messages named `stdout` while it is produced (batched: at most
  64 KiB or 50 ms per message, and waiting when ipykernel's IOPub queue backs up, so a
  flood keeps the kernel's memory bounded). All of it is published before the reply.
  Output of a background job written between cells arrives with the next cell.
- Status: the marker's `$?` is the status of the cell's last command; nonzero gives an
  `error` reply and message: ename `ExitStatus`, evalue `exit status N`, traceback [].
- Interrupts: ipykernel sends SIGINT to the kernel process (signal mode; an
  interrupt_request does the same). While a request runs, this kernel's own SIGINT
  handler (installed in pre_handler_hook, with a wakeup fd that breaks the select) only
  notes it; the cell loop then sends SIGINT to the pty's foreground process group: the
  running job dies and interactive bash abandons the rest of the sourced cell (or bash
  itself, when busy in a builtin loop, goes back to its prompt). If no prompt comes
  within 2 s, bash is sent SIGINT and the foreground group SIGKILL (so the rest of the
  cell is abandoned too); if bash itself was that group (it ignores SIGINT), or there is
  still no prompt 2 s later, bash is killed and a new one started. The cell ends with ename
  `KeyboardInterrupt`; bash and its state survive unless bash itself had to be killed.
  The newline bash prints when it abandons a command (where a terminal shows `^C`) is
  left out of the output.
- `exit` (or bash dying some other way, `set -e` and a failure included): the cell's
  output is published, the cell ends with ename `BashExited` (evalue says the status and
  that the state was reset), what remains of the old session gets SIGHUP, and the kernel
  starts a new bash right away (the kernel itself stays up, as with PyPI's bash_kernel,
  which also restarts bash): the next cell runs in a fresh shell in the kernel's
  original working directory and environment.
- Silent requests (the driver's per-cell `export`s and their restore) run the same way
  but publish nothing; ipykernel leaves the execution count alone for them.
- Shutdown (and the kernel's exit): SIGKILL to every process of bash's session, then the
  temp dir is removed. A kernel killed outright (SIGKILL) cannot clean up: closing its pty
  hangs bash up (interactive bash passes SIGHUP on to its jobs), and the next kernel to
  start removes temp dirs left by kernels that are gone.

Limits: a cell that sets PS1, turns off `promptvars` or sends bash's own stderr elsewhere
(`exec 2>file`) hides the marker: it runs until interrupted (and then bash is restarted).
The cell's code runs as it is (CRLF line ends are not translated). Job notices (`[1] 123`,
`[1]+ Done ...`) are printed by bash as in a terminal: a `Done` notice shows up in the
output of the cell during or after which the job ended.
"""

import atexit
import codecs
import errno
import fcntl
import os
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import tempfile
import termios
import time

from ipykernel.kernelbase import Kernel

__version__ = "1.0"

CHUNK = 64 * 1024  # at most this much text per stream message
LINGER_S = 0.05  # output waits at most this long before it is published
INTERRUPT_GRACE_S = 2.0  # after SIGINT, wait this long for the prompt, then SIGKILL the job
KILL_GRACE_S = 2.0  # after that, wait this long, then kill bash itself
START_TIMEOUT_S = 20.0
IOPUB_BACKLOG = 32  # ipykernel IOPub events queued before publishing waits
DIR_PREFIX = "locker-bash-"
WINSIZE = (24, 80)
# Signals Python or ipykernel ignore or handle: bash and what it runs get the defaults.
RESET_SIGNALS = [
    getattr(signal, name)
    for name in (
        "SIGINT", "SIGPIPE", "SIGXFSZ", "SIGXFZ", "SIGTERM", "SIGQUIT", "SIGHUP", "SIGCHLD",
        "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGUSR1", "SIGUSR2", "SIGALRM",
    )
    if hasattr(signal, name)
]


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale_dirs():
    """Removes temp dirs of this uid left by kernels that are gone (killed with SIGKILL)."""
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        if not name.startswith(DIR_PREFIX):
            continue
        pid = name[len(DIR_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        path = os.path.join(base, name)
        try:
            if os.lstat(path).st_uid == uid:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _session_members(sid):
    """Pids of the processes in session `sid` (bash's, with all its jobs)."""
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry, "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 3 and fields[3] == str(sid).encode():
            pids.append(int(entry))
    return pids


class _Output:
    """One cell's output: bytes from the pty in, text published in batches."""

    def __init__(self, kernel, publish):
        self.kernel = kernel
        self.publish = publish
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.parts = []
        self.size = 0
        self.since = None
        self.cr = False  # a trailing "\r" held back: it may start a "\r\n"

    def add(self, data, final=False):
        text = self.decoder.decode(data, final)
        if self.cr:
            text = "\r" + text
            self.cr = False
        if text.endswith("\r") and not final:
            text = text[:-1]
            self.cr = True
        text = text.replace("\r\n", "\n")
        if text:
            self.parts.append(text)
            self.size += len(text)
            if self.since is None:
                self.since = time.monotonic()

    def wait_s(self, now):
        """Seconds until the pending text is due (None: nothing pending)."""
        if not self.parts:
            return None
        if self.size >= CHUNK:
            return 0.0
        return max(0.0, self.since + LINGER_S - now)

    def flush(self):
        if not self.parts:
            return
        text = "".join(self.parts)
        self.parts, self.size, self.since = [], 0, None
        if self.publish:
            self.kernel.publish_stream(text)

    def finish(self):
        self.add(b"", final=True)
        self.flush()


class LockerBashKernel(Kernel):
    implementation = "locker_bash"
    implementation_version = __version__
    language = "bash"
    language_version = ""
    language_info = {
        "name": "bash",
        "codemirror_mode": "shell",
        "mimetype": "text/x-sh",
        "file_extension": ".sh",
        "pygments_lexer": "bash",
    }
    banner = "Locker bash kernel"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._interrupt_pending = False
        self._shutting_down = False
        self._running = False
        self._bash_pid = None
        self._fd = None
        self._tty_attrs = None
        self._leftover = b""
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._saved_wakeup_fd = None
        token = os.urandom(8).hex()
        self._mark = ("[locker-%s:" % token).encode()
        self._mark_re = re.compile(re.escape(self._mark) + rb"(\d{1,3})\]")
        self._prompt = "[locker-%s:$?]" % token
        self._version_re = re.compile(rb"\[locker-%s-version:([^\]\n]*)\]" % token.encode())
        _sweep_stale_dirs()
        self._dir = tempfile.mkdtemp(prefix="%s%d-" % (DIR_PREFIX, os.getpid()))
        self._cell_path = os.path.join(self._dir, "cell.sh")
        atexit.register(self._cleanup)
        self._start_bash()
        version = self.language_info.get("version") or ""
        self.language_version = version
        self.banner = "Locker bash kernel (GNU bash %s)" % version if version else self.banner

    # ---- bash on its pty -------------------------------------------------------------

    def _start_bash(self):
        bash = shutil.which("bash") or "/bin/bash"
        argv = [bash, "--noprofile", "--norc", "--noediting", "-i"]
        env = dict(os.environ)
        for name in ("PROMPT_COMMAND", "PS0", "PS1", "PS2", "PS4", "HISTFILE", "TMOUT",
                     "BASH_ENV", "ENV", "MAILCHECK", "MAILPATH", "MAIL", "COLUMNS", "LINES"):
            env.pop(name, None)
        env["TERM"] = "dumb"
        env["PAGER"] = "cat"
        rc_path = os.path.join(self._dir, "rc.sh")
        with open(rc_path, "w") as f:
            f.write(
                "PS1=%s\nPS2=\n"
                "unset PS0 PROMPT_COMMAND HISTFILE MAILCHECK MAILPATH MAIL TMOUT\n"
                "set +o history\nprintf '\\n[locker-%s-version:%%s]\\n' \"$BASH_VERSION\"\n"
                % (shlex.quote(self._prompt), self._mark[len(b"[locker-"):-1].decode())
            )
        winsize = struct.pack("HHHH", WINSIZE[0], WINSIZE[1], 0, 0)
        pid, fd = os.forkpty()
        if pid == 0:  # the child: as little Python as possible, then bash
            try:
                attrs = termios.tcgetattr(0)
                attrs[1] &= ~termios.ONLCR
                attrs[3] &= ~(termios.ECHO | termios.ECHONL)
                termios.tcsetattr(0, termios.TCSANOW, attrs)
                fcntl.ioctl(0, termios.TIOCSWINSZ, winsize)
                for sig in RESET_SIGNALS:
                    signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, [])
                os.closerange(3, 1 << 16)
                os.execve(bash, argv, env)
            finally:
                os._exit(127)
        self._bash_pid, self._fd = pid, fd
        self._leftover = b""
        self._write(b" . %s\n" % shlex.quote(rc_path).encode())
        out = self._wait_prompt(time.monotonic() + START_TIMEOUT_S)
        try:
            os.unlink(rc_path)
        except OSError:
            pass
        if out is None:
            self._kill_session(signal.SIGKILL)
            raise RuntimeError("bash did not start (no prompt within %ds)" % START_TIMEOUT_S)
        m = self._version_re.search(out)
        if m:
            self.language_info = dict(self.language_info, version=m.group(1).decode())
        self._tty_attrs = termios.tcgetattr(self._fd)

    def _wait_prompt(self, deadline):
        """At start: reads until the first marker, returns what came before (None: none)."""
        buf = b""
        while time.monotonic() < deadline:
            r, _, _ = select.select([self._fd], [], [], 0.1)
            if r:
                data = self._read()
                if not data:
                    return None
                buf += data
                m = self._mark_re.search(buf)
                if m:
                    self._leftover = buf[m.end():]
                    return buf[:m.start()]
            elif self._poll_bash() is not None:
                return None
        return None

    def _write(self, data):
        while data:
            try:
                n = os.write(self._fd, data)
            except InterruptedError:
                continue
            data = data[n:]

    def _read(self):
        """One chunk from the pty; b"" once the pty is closed (bash and its jobs gone)."""
        try:
            return os.read(self._fd, CHUNK)
        except InterruptedError:
            return self._read()
        except OSError as e:
            if e.errno == errno.EIO:
                return b""
            raise

    def _drain_pty(self):
        """What is still in the pty once bash ended (bounded: a job may keep writing)."""
        data = []
        until = time.monotonic() + 0.2
        try:
            while time.monotonic() < until and select.select([self._fd], [], [], 0)[0]:
                chunk = self._read()
                if not chunk:
                    break
                data.append(chunk)
        except (OSError, ValueError):
            pass
        return b"".join(data)

    def _poll_bash(self, wait=False):
        """Bash's exit status if it ended (negative: killed by that signal), else None."""
        if self._bash_pid is None:
            return None
        try:
            pid, status = os.waitpid(self._bash_pid, 0 if wait else os.WNOHANG)
        except ChildProcessError:
            return -1
        if pid == 0:
            return None
        return os.waitstatus_to_exitcode(status)

    def _reap(self):
        """Bash's status once its pty is closed: it is ending (or killed if it lingers)."""
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            exited = self._poll_bash()
            if exited is not None:
                return exited
            time.sleep(0.01)
        try:
            os.kill(self._bash_pid, signal.SIGKILL)
        except OSError:
            pass
        return self._poll_bash(wait=True)

    def _signal_foreground(self, sig):
        """Signals the pty's foreground process group (the running job, or bash itself)."""
        try:
            pgrp = os.tcgetpgrp(self._fd)
        except OSError:
            pgrp = self._bash_pid
        try:
            os.killpg(pgrp, sig)
        except OSError:
            pass
        return pgrp

    def _kill_session(self, sig):
        """Signals every process of bash's session (bash and all its jobs)."""
        sid = self._bash_pid
        if sid is None:
            return
        for pid in [sid] + [p for p in _session_members(sid) if p != sid]:
            try:
                os.kill(pid, sig)
                if sig == signal.SIGHUP:
                    os.kill(pid, signal.SIGCONT)
            except OSError:
                pass

    def _drop_bash(self, sig):
        """Forgets a bash that ended: signals what is left of its session, closes the pty."""
        self._kill_session(sig)
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None
        self._bash_pid = None
        self._leftover = b""

    def _cleanup(self):
        if self._bash_pid is not None:
            self._kill_session(signal.SIGKILL)
            self._poll_bash(wait=True)
            self._drop_bash(signal.SIGKILL)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- interrupts -------------------------------------------------------------------

    def pre_handler_hook(self):
        self._interrupt_pending = False
        self.saved_sigint_handler = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            self._saved_wakeup_fd = signal.set_wakeup_fd(
                self._wake_w, warn_on_full_buffer=False
            )
        except (ValueError, OSError):
            self._saved_wakeup_fd = None

    def post_handler_hook(self):
        signal.signal(signal.SIGINT, self.saved_sigint_handler)
        if self._saved_wakeup_fd is not None:
            try:
                signal.set_wakeup_fd(self._saved_wakeup_fd)
            except (ValueError, OSError):
                pass
            self._saved_wakeup_fd = None

    def _on_sigint(self, signum, frame):
        self._interrupt_pending = True
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass

    def _drain_wake(self):
        try:
            while os.read(self._wake_r, 512):
                pass
        except OSError:
            pass

    # ---- cells ------------------------------------------------------------------------

    def publish_stream(self, text):
        # Wait while ipykernel's IO thread is behind, so a flood stays in the pty.
        events = getattr(getattr(self, "iopub_thread", None), "_events", None)
        if events is not None:
            until = time.monotonic() + 5.0
            while (
                len(events) > IOPUB_BACKLOG
                and time.monotonic() < until
                and not self._interrupt_pending
            ):
                time.sleep(0.002)
        self.send_response(self.iopub_socket, "stream", {"name": "stdout", "text": text})

    def _run(self, code, publish):
        """Runs one cell; returns ("status", N), ("interrupted", bash_restarted) or
        ("exited", bash_status)."""
        if self._bash_pid is None:
            self._start_bash()
        if not code.endswith("\n"):
            code += "\n"
        with open(self._cell_path, "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        try:
            termios.tcsetattr(self._fd, termios.TCSANOW, self._tty_attrs)
        except (OSError, termios.error):
            pass
        self._drain_wake()
        self._write(b" . %s </dev/null\n" % shlex.quote(self._cell_path).encode())
        out = _Output(self, publish)
        buf, self._leftover = self._leftover, b""
        mark = self._mark
        interrupted_at = killed_at = None
        bash_killed = False
        exited = None
        status = None
        next_poll = time.monotonic() + 0.25
        while True:
            # Split what was read into output and (maybe) the prompt marker.
            if buf:
                m = self._mark_re.search(buf)
                if m:
                    head = buf[:m.start()]
                    if interrupted_at is not None and head.endswith(b"\n"):
                        head = head[:-1]  # the newline bash prints when interrupted
                    out.add(head)
                    self._leftover = buf[m.end():]
                    status = int(m.group(1))
                    break
                i = buf.rfind(mark)
                if i >= 0 and len(buf) - i < len(mark) + 5:
                    keep = len(buf) - i  # a marker still arriving
                else:
                    keep = 0
                    for k in range(min(len(mark) - 1, len(buf)), 0, -1):
                        if buf.endswith(mark[:k]):
                            keep = k
                            break
                    if not keep and interrupted_at is not None and buf.endswith(b"\n"):
                        keep = 1  # maybe bash's newline after an interrupt: see the marker
                out.add(buf[:len(buf) - keep])
                buf = buf[len(buf) - keep:]
            now = time.monotonic()
            if out.wait_s(now) == 0.0:
                out.flush()
            # Bash gone (even while a job it left keeps writing on the pty)?
            if now >= next_poll:
                next_poll = now + 0.25
                exited = self._poll_bash()
                if exited is not None:
                    buf += self._drain_pty()
                    break
            # Interrupts, then the escalation when the prompt does not come back.
            if self._interrupt_pending:
                self._interrupt_pending = False
                self._drain_wake()
                if interrupted_at is None:
                    interrupted_at = now
                self._signal_foreground(signal.SIGINT)
            if interrupted_at is not None and killed_at is None and (
                now - interrupted_at >= INTERRUPT_GRACE_S
            ):
                killed_at = now
                try:
                    os.kill(self._bash_pid, signal.SIGINT)
                except OSError:
                    pass
                if self._signal_foreground(signal.SIGKILL) == self._bash_pid:
                    bash_killed = True
            if killed_at is not None and not bash_killed and now - killed_at >= KILL_GRACE_S:
                bash_killed = True
                try:
                    os.kill(self._bash_pid, signal.SIGKILL)
                except OSError:
                    pass
            # Wait for output, an interrupt, or a deadline.
            waits = [0.25]
            pending = out.wait_s(now)
            if pending is not None:
                waits.append(pending)
            if interrupted_at is not None and killed_at is None:
                waits.append(interrupted_at + INTERRUPT_GRACE_S - now)
            if killed_at is not None and not bash_killed:
                waits.append(killed_at + KILL_GRACE_S - now)
            try:
                ready, _, _ = select.select(
                    [self._fd, self._wake_r], [], [], max(0.0, min(waits))
                )
            except InterruptedError:
                continue
            except (OSError, ValueError):  # the pty is gone (shutdown)
                exited = self._reap()
                break
            if self._wake_r in ready:
                self._drain_wake()
            if self._fd in ready:
                data = self._read()
                if data:
                    buf += data
                    continue
                exited = self._reap()
                break
            if not ready or self._shutting_down:
                next_poll = 0.0
        if exited is not None:
            buf = self._mark_re.sub(b"", buf)
            out.add(buf)
        out.finish()
        if exited is not None:
            self._drop_bash(signal.SIGHUP)
            if not self._shutting_down:
                self._start_bash()
            if interrupted_at is not None:
                return "interrupted", True
            return "exited", exited
        if interrupted_at is not None:
            return "interrupted", False
        return "status", status

    def do_execute(self, code, silent, store_history=True, user_expressions=None,
                   allow_stdin=False, *, cell_id=None):
        ok = {"status": "ok", "execution_count": self.execution_count, "payload": [],
              "user_expressions": {}}
        if not code.strip():
            return ok
        if self._shutting_down:
            ename, evalue = "KernelShuttingDown", "the kernel is shutting down"
        else:
            self._running = True
            try:
                kind, value = self._run(code, publish=not silent)
            except Exception as e:  # bash cannot be started, the pty failed: said as it is
                self.log.error("bash cell failed", exc_info=True)
                kind, value = "failed", "%s: %s" % (type(e).__name__, e)
            finally:
                self._running = False
            if kind == "status" and value == 0:
                return ok
            if kind == "status":
                ename, evalue = "ExitStatus", "exit status %d" % value
            elif kind == "interrupted":
                ename = "KeyboardInterrupt"
                evalue = "interrupted"
                if value:
                    evalue += (
                        "; bash did not stop and was killed: a new bash was started "
                        "(variables, functions, aliases and the working directory were reset)"
                    )
            elif kind == "failed":
                ename, evalue = "KernelError", value
            else:
                how = "status %d" % value if value >= 0 else "killed by signal %d" % -value
                try:
                    if value < 0:
                        how = "killed by %s" % signal.Signals(-value).name
                except ValueError:
                    pass
                ename = "BashExited"
                evalue = (
                    "bash exited (%s): a new bash was started (variables, functions, "
                    "aliases and the working directory were reset)" % how
                )
        error = {"ename": ename, "evalue": evalue, "traceback": []}
        if not silent:
            self.send_response(self.iopub_socket, "error", error)
        return dict(error, status="error", execution_count=self.execution_count)

    def do_is_complete(self, code):
        try:
            r = subprocess.run(
                ["bash", "-n"], input=code.encode("utf-8", "replace"), capture_output=True,
                timeout=5,
            )
        except (OSError, subprocess.SubprocessError):
            return {"status": "unknown"}
        if r.returncode == 0:
            return {"status": "complete"}
        if b"unexpected end of file" in r.stderr or b"here-document" in r.stderr:
            return {"status": "incomplete", "indent": ""}
        return {"status": "invalid"}

    def do_shutdown(self, restart):
        # Runs on ipykernel's control thread, maybe while a cell runs on the main one: the
        # cell's loop sees bash die; the pty and the temp dir go when the process exits.
        self._shutting_down = True
        if self._running:
            self._kill_session(signal.SIGKILL)
        else:
            self._cleanup()
        return {"status": "ok", "restart": restart}


if __name__ == "__main__":
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(kernel_class=LockerBashKernel)
