"""Runs inside a microVM guest of Locker (a kernel whose cgroup hierarchy is v2 only) and
drives a nested `locker serve` there over HTTP: jails on cgroup v2, checked from inside
the jail and from the guest around it, then serverless runs on a volume. Exits non-zero with a message on the first failure;
prints one line per step with its time. Used by tests/cgroup_v2.rs."""
import json
import os
import sys
import time
import urllib.request

U = "http://127.0.0.1:7000"
K = sys.argv[1]


def req(method, path, body=None, timeout=600):
    r = urllib.request.Request(
        U + path, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {K}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(r, timeout=timeout) as f:
            data = f.read()
            return f.status, (json.loads(data) if data else None)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", flush=True)
        sys.exit(1)


for _ in range(600):
    try:
        urllib.request.urlopen(U + "/healthz", timeout=2).read()
        break
    except Exception:
        time.sleep(0.2)
else:
    check(False, "the nested server never answered /healthz")

t = time.perf_counter()
st, sb = req("POST", "/v1/sandboxes", {"runtime": "jail", "memory_mb": 128, "disk_mb": 256})
check(st == 201, f"create a jail: {st} {sb}")
sid = sb["id"]
print(f"create {(time.perf_counter() - t) * 1e3:.0f} ms {sid}", flush=True)


def ex(cmd, **kw):
    t = time.perf_counter()
    st, r = req("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["sh", "-c", cmd], **kw})
    check(st == 200, f"exec {cmd!r}: {st} {r}")
    print(f"exec {(time.perf_counter() - t) * 1e3:.0f} ms exit {r['exit_code']} "
          f"reason {r['reason']} usage {r['usage']}: {cmd[:60]!r}", flush=True)
    return r


# The machine's cgroup on the guest: locker/<id>.<tag> (a tag of the machine's directory),
# PID 1 in its init leaf, the controllers delegated below it.
named = [d for d in os.listdir("/sys/fs/cgroup/locker") if d.startswith(f"{sid}.")]
check(len(named) == 1, f"one cgroup for {sid}: {named}")
mdir = f"/sys/fs/cgroup/locker/{named[0]}"
check(os.path.isdir(mdir), f"{mdir} missing")
with open(f"{mdir}/memory.max") as f:
    check(f.read().strip() == str(128 << 20), "the machine's memory.max")
with open(f"{mdir}/cgroup.subtree_control") as f:
    ctl = f.read().split()
    check({"memory", "pids", "cpu"} <= set(ctl), f"controllers delegated: {ctl}")
with open(f"{mdir}/init/cgroup.procs") as f:
    check(len(f.read().split()) == 1, "PID 1 alone in init")
# PID 1 was cloned into init (no move): the shim notes in machine.log when it had to fall
# back to a move.
logs = [os.path.join(d, "machine.log") for d, _, fs in os.walk("/root/d")
        if os.path.basename(d) == sid and "machine.log" in fs]
check(len(logs) == 1, f"the machine's log: {logs}")
with open(logs[0]) as f:
    log = f.read()
check("could not be cloned into its cgroup" not in log, f"PID 1 moved instead: {log}")
# The shim is the small `locker-jail` when the test handed one in beside `locker`.
if len(sys.argv) > 2:
    with open(os.path.join(os.path.dirname(logs[0]), "state.json")) as f:
        shim = json.load(f)["shim_pid"]
    exe = os.readlink(f"/proc/{shim}/exe")
    check(exe == sys.argv[2], f"the machine's shim runs {exe}, not {sys.argv[2]}")

# Inside: its own cgroup namespace, each command in a cgroup of its own below the root.
r = ex("cat /proc/self/cgroup; cat /sys/fs/cgroup/memory.max /sys/fs/cgroup/pids.max")
lines = r["stdout"].split()
v2 = [l for l in lines if l.startswith("0::")]
check(len(v2) == 1 and v2[0].startswith("0::/cmd-"), f"the command's cgroup: {lines}")
check(str(128 << 20) in lines, f"memory.max seen inside: {lines}")
check(lines[-1].isdigit(), f"pids.max set: {lines}")
# PID 1 lives in init, and the machine's cgroup namespace is rooted at the machine's cgroup.
r = ex("cat /proc/1/cgroup")
check([l for l in r["stdout"].split() if l.startswith("0::")] == ["0::/init"],
      f"PID 1's cgroup inside: {r['stdout']}")

r = ex("python3 -c 'sum(range(3_000_000))'")
check(r["exit_code"] == 0 and r["usage"]["cpu_ms"] > 0, f"CPU counted: {r['usage']}")

r = ex("python3 -c 'a = bytearray(400 << 20)'")
check(r["reason"] == "oom", f"400 MB in a 128 MB machine: {r['reason']}")

r = ex("setsid sh -c 'sleep 300 & echo $! > /tmp/gc'; sleep 300", timeout_ms=1500)
check(r["reason"] == "timeout", f"timeout: {r['reason']}")
r = ex("kill -0 $(cat /tmp/gc) 2>/dev/null && echo alive || echo gone")
check(r["stdout"].strip() == "gone", "the timed-out command's setsid grandchild survived")

# A cgroup a command makes for itself is a stray: killed and removed when a command ends.
ex("mkdir /sys/fs/cgroup/mine && echo $$ > /sys/fs/cgroup/mine/cgroup.procs && (sleep 300 &) ; echo moved")
ex("true")
r = ex("ls /sys/fs/cgroup; pgrep -c sleep || true")
check("mine" not in r["stdout"].split(), f"the stray cgroup was kept: {r['stdout']}")
check(r["stdout"].split()[-1] == "0", f"the stray's process survived: {r['stdout']}")

# Back to back, the exec path on v2 (jail: the agent forks and joins; seccomp refuses clone3).
times = []
for _ in range(10):
    t = time.perf_counter()
    st, r = req("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["true"]})
    check(st == 200 and r["exit_code"] == 0, f"true: {st} {r}")
    times.append((time.perf_counter() - t) * 1e3)
times.sort()
print(f"exec true x10: p50 {times[5]:.0f} ms, max {times[-1]:.0f} ms", flush=True)

# Destroy: the machine's cgroup and its loop devices are gone.
st, _ = req("DELETE", f"/v1/sandboxes/{sid}")
check(st == 204, f"delete: {st}")
check(not os.path.exists(mdir), f"{mdir} left after the delete")
left = []
for dev in os.listdir("/sys/block"):
    bf = f"/sys/block/{dev}/loop/backing_file"
    if os.path.exists(bf):
        with open(bf) as f:
            if sid in f.read():
                left.append(dev)
check(not left, f"loop devices left: {left}")

# Serverless runs on a volume (its own btrfs filesystem): a fresh machine per call, born
# in its cgroup on v2 like a sandbox's, its changes committed, nothing of it left after.
st, vol = req("POST", "/v1/volumes", {"name": "v2-runs", "size_mb": 512})
check(st == 201, f"create a volume: {st} {vol}")
vid = vol["id"]


def run(cmd):
    t = time.perf_counter()
    st, r = req("POST", f"/v1/volumes/{vid}/run", {"cmd": ["sh", "-c", cmd], "memory_mb": 128})
    check(st == 200, f"run {cmd!r}: {st} {r}")
    print(f"run {(time.perf_counter() - t) * 1e3:.0f} ms exit {r['exit_code']}: {cmd[:60]!r}",
          flush=True)
    return r


r = run("echo kept > /workspace/f; cat /proc/self/cgroup /proc/1/cgroup /sys/fs/cgroup/memory.max")
check(r["exit_code"] == 0, f"the first run: {r}")
lines = r["stdout"].split()
v2 = [l for l in lines if l.startswith("0::")]
check(len(v2) == 2 and v2[0].startswith("0::/cmd-") and v2[1] == "0::/init",
      f"the run's command and PID 1 in the run machine's cgroups: {lines}")
check(str(128 << 20) in lines, f"the run's memory limit: {lines}")
r = run("cat /workspace/f")
check(r["stdout"].strip() == "kept", f"the first run's change, committed: {r}")
r = run("python3 -c 'a = bytearray(400 << 20)'")
check(r["reason"] == "oom", f"400 MB in a 128 MB run: {r['reason']}")
times = []
for _ in range(5):
    t = time.perf_counter()
    run("true")
    times.append((time.perf_counter() - t) * 1e3)
times.sort()
print(f"run true x5: p50 {times[2]:.0f} ms", flush=True)
st, _ = req("DELETE", f"/v1/volumes/{vid}")
check(st == 204, f"delete the volume: {st}")
stale = [d for d in os.listdir("/sys/fs/cgroup/locker")
         if os.path.isdir(f"/sys/fs/cgroup/locker/{d}")]
check(not stale, f"machines' cgroups left after the runs: {stale}")
print("ok", flush=True)
