"""The E2B layer's cost (issue 19's bench rows), against a running `locker serve`: a new
sandbox and its first command, `Sandbox.create()` then `commands.run("echo hi")`, through
E2B's unmodified Python SDK (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY) next to the same two
calls through Locker's own Python SDK (LOCKER_URL, LOCKER_API_KEY; `sdk/python`), in the
same run, alternating: p50 and p99 of each and of the difference. The contract: the E2B
layer adds under 5 ms p50. When the server does not serve envd's `Start` yet, only the
creates are measured, and the output says so. `cargo test --release -p locker-tests --test
e2b_control -- --ignored e2b_figures --nocapture` runs it against a test server.
"""
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sdk", "python", "src"))
from locker import Client
from e2b import Sandbox

N = int(os.environ.get("E2B_BENCH_N", "20"))
c = Client(os.environ["LOCKER_URL"], os.environ["LOCKER_API_KEY"])


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def e2b_once(with_command):
    t0 = time.perf_counter()
    sbx = Sandbox.create(timeout=120)
    if with_command:
        assert sbx.commands.run("echo hi").stdout == "hi\n"
    ms = (time.perf_counter() - t0) * 1000
    sbx.kill()
    return ms


def locker_once(with_command):
    t0 = time.perf_counter()
    sb = c.sandboxes.create(ttl_s=120)
    if with_command:
        # What E2B's SDK asks for: `bash -l -c` as the user `user`; the same command both
        # ways, so that the difference is the layer's and not a login shell's start-up.
        assert sb.exec(cmd=["/bin/bash", "-l", "-c", "echo hi"], user="user").stdout == "hi\n"
    ms = (time.perf_counter() - t0) * 1000
    sb.delete()
    return ms


# Does this server run E2B commands (envd's process.Process/Start)?
with_command = True
probe = Sandbox.create(timeout=60)
try:
    probe.commands.run("echo hi")
except Exception as e:  # noqa: BLE001 - any failure means: not served here
    with_command = False
    print(f"envd's Start is not served by this server ({type(e).__name__}: {e}); measuring create alone")
finally:
    probe.kill()

e2b_ms, locker_ms = [], []
for _ in range(N):
    e2b_ms.append(e2b_once(with_command))
    locker_ms.append(locker_once(with_command))
what = "create + echo hi" if with_command else "create"
diff = [a - b for a, b in zip(e2b_ms, locker_ms)]
print(f"{what}, n={N}:")
print(f"  E2B SDK     p50 {pct(e2b_ms, 50):7.1f} ms  p99 {pct(e2b_ms, 99):7.1f} ms")
print(f"  Locker SDK  p50 {pct(locker_ms, 50):7.1f} ms  p99 {pct(locker_ms, 99):7.1f} ms")
print(f"  E2B layer   p50 {pct(diff, 50):+7.1f} ms (pairwise difference; the contract: < 5 ms)")

if with_command:
    # The command alone, in one running sandbox each way (alternating): what a command
    # costs once the sandbox exists, without the create and the first connection.
    sbx = Sandbox.create(timeout=120)
    sb = c.sandboxes.create(ttl_s=120)
    try:
        sbx.commands.run("echo hi")
        sb.exec(cmd=["/bin/bash", "-l", "-c", "echo hi"], user="user")
        warm_e2b, warm_locker = [], []
        for _ in range(N):
            t0 = time.perf_counter()
            assert sbx.commands.run("echo hi").stdout == "hi\n"
            warm_e2b.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            assert sb.exec(cmd=["/bin/bash", "-l", "-c", "echo hi"], user="user").stdout == "hi\n"
            warm_locker.append((time.perf_counter() - t0) * 1000)
    finally:
        sbx.kill()
        sb.delete()
    wdiff = [a - b for a, b in zip(warm_e2b, warm_locker)]
    print(f"echo hi in a running sandbox, n={N}:")
    print(f"  E2B SDK     p50 {pct(warm_e2b, 50):7.1f} ms  p99 {pct(warm_e2b, 99):7.1f} ms")
    print(f"  Locker SDK  p50 {pct(warm_locker, 50):7.1f} ms  p99 {pct(warm_locker, 99):7.1f} ms")
    print(f"  difference  p50 {pct(wdiff, 50):+7.1f} ms (pairwise)")
