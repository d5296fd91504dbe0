"""An agent's tool calls through E2B's own Python SDK, served by Locker.

Nothing here is Locker-specific: the same script runs against E2B's cloud. Point it at
Locker with three variables (see docs/e2b.md):

    pip install e2b
    export E2B_API_URL=http://127.0.0.1:7070 E2B_SANDBOX_URL=http://127.0.0.1:7070
    export E2B_API_KEY=e2b_...        # locker key create --tenant default --e2b
    python3 examples/e2b/agent_tools.py

It does what a coding agent's tools do: make a sandbox tagged with the session, write a
program, run it and read its output, keep the sandbox paused between turns, snapshot it
before a risky step, try two variants on forks, and clean up.
"""

import sys
import uuid

from e2b import Sandbox, SandboxQuery

PROGRAM = """
import sys
def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
print(fib(int(sys.argv[1])))
"""


def main() -> int:
    session = uuid.uuid4().hex[:12]
    sbx = Sandbox.create(timeout=600, metadata={"session": session}, envs={"AGENT": "demo"})
    print(f"sandbox {sbx.sandbox_id} for session {session}")
    forks = []
    try:
        # Tool call 1: write a file, run it.
        sbx.files.write("/home/user/fib.py", PROGRAM)
        out = sbx.commands.run("python3 /home/user/fib.py 30")
        print("fib(30) =", out.stdout.strip())

        # Between turns the sandbox sleeps; the next call finds it by its session tag.
        sbx.pause()
        found = Sandbox.list(query=SandboxQuery(metadata={"session": session})).next_items()
        assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
        sbx = Sandbox.connect(found[0].sandbox_id)
        print("resumed:", sbx.commands.run("echo $AGENT; whoami").stdout.split())

        # Before a risky step: a snapshot, and two variants tried side by side on forks.
        snap = sbx.create_snapshot()
        print("snapshot", snap.snapshot_id)
        forks = sbx.fork(count=2, timeout=120)
        for fork, n in zip(forks, (10, 20)):
            r = fork.commands.run(f"python3 /home/user/fib.py {n}")
            print(f"fork {fork.sandbox_id}: fib({n}) =", r.stdout.strip())
        Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        for s in [sbx, *forks]:
            if not isinstance(s, Exception):
                s.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
