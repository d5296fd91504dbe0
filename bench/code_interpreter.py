"""The code interpreter's figures (issue 18's bench rows), against a running `locker serve`
(LOCKER_URL, LOCKER_API_KEY) whose host has the code-interpreter template: a new sandbox's
first cell (create + run_code("1+1"), cold: the driver and the kernel start then), a warm
cell `x + 1` over HTTP (p50, p99), a warm matplotlib chart cell (a 100-point line to PNG),
and the PSS of idle kernels. `cargo test --release -p locker-tests --test code -- --ignored
code_interpreter_figures --nocapture` runs it against a test server.
"""
import os, sys, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sdk", "python", "src"))
from locker import Client
c = Client(os.environ["LOCKER_URL"], os.environ["LOCKER_API_KEY"])
def pct(xs, p): xs = sorted(xs); return xs[min(len(xs)-1, int(round(p/100*(len(xs)-1))))]
firsts = []
for i in range(3):
    t0 = time.perf_counter()
    sb = c.sandboxes.create(template="code-interpreter", ttl_s=600)
    t1 = time.perf_counter()
    ex = sb.run_code("1+1")
    t2 = time.perf_counter()
    assert ex.text == "2", ex
    firsts.append((t2 - t0) * 1000)
    print("first cell: create %.0f ms + first cell %.0f ms (driver+kernel start)" % ((t1-t0)*1000, (t2-t1)*1000))
    if i < 2: sb.delete()
ctx = sb.create_code_context()
ctx.run_code("x = 1")
warm = []
for _ in range(300):
    t0 = time.perf_counter(); ex = ctx.run_code("x + 1"); warm.append((time.perf_counter() - t0) * 1000)
    assert ex.text == "2"
print("warm x+1 over HTTP: p50 %.1f ms p99 %.1f ms (n=300)" % (pct(warm, 50), pct(warm, 99)))
ctx.run_code("import matplotlib.pyplot as plt")
chart = []
for _ in range(20):
    t0 = time.perf_counter(); ex = ctx.run_code("plt.plot(range(100))\nplt.show()"); chart.append((time.perf_counter() - t0) * 1000)
    assert any(r.png for r in ex.results)
print("chart cell (100-point line to PNG), warm: p50 %.0f ms" % pct(chart, 50))
idle = sb.create_code_context()
idle.run_code("1")
pss = sb.exec(shell="for p in $(pgrep -f ipykernel_launcher); do awk '/^Pss:/{print $2}' /proc/$p/smaps_rollup; done").stdout.split()
print("PSS of idle kernels (KiB):", pss)
mem = sb.exec(shell="grep MemTotal /proc/meminfo").stdout
print("sandbox", mem.strip())
sb.delete()
