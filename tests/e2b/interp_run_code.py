"""Drives E2B's unmodified `e2b-code-interpreter` SDK against Locker the way its users do:
run_code with state across calls, output callbacks, a matplotlib chart, a pandas DataFrame,
an exception, a cell's own environment variables, the working directory E2B's contexts
start in, a sandbox killed under a cell. Prints what it saw as one JSON line; the Rust test
(tests/e2b_interp.rs) judges it.

Environment: E2B_API_URL and E2B_SANDBOX_URL (Locker's URL), E2B_API_KEY (a Locker key).
"""

import base64
import json
import struct
import threading

from e2b import TimeoutException
from e2b_code_interpreter import Sandbox

seen = {}
sbx = Sandbox.create()  # the SDK's default template, code-interpreter-v1
try:
    seen["sandbox"] = sbx.sandbox_id

    first = sbx.run_code("import math\nx = 41")
    second = sbx.run_code("x + 1")
    seen["state"] = second.text
    seen["counts"] = [first.execution_count, second.execution_count]
    seen["import_kept"] = sbx.run_code("math.sqrt(16)").text

    out, err = [], []
    cb = sbx.run_code(
        "import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)",
        on_stdout=lambda m: out.append(m.line),
        on_stderr=lambda m: err.append(m.line),
    )
    seen["callbacks"] = {"stdout": out, "stderr": err}
    seen["logs"] = {"stdout": cb.logs.stdout, "stderr": cb.logs.stderr}

    chart = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot(range(100))\n"
        "plt.title('a line')\n"
        "plt.show()"
    )
    pngs = [r.png for r in chart.results if r.png]
    seen["pngs"] = len(pngs)
    if pngs:
        raw = base64.b64decode(pngs[0])
        width, height = struct.unpack(">II", raw[16:24])
        seen["png"] = {
            "signature": raw[:8] == b"\x89PNG\r\n\x1a\n",
            "iend": raw[-8:-4] == b"IEND",
            "width": width,
            "height": height,
        }

    table = sbx.run_code(
        "import pandas as pd\npd.DataFrame({'city': ['Oslo', 'Lima'], 'pop': [709, 10092]})"
    )
    main = [r for r in table.results if r.is_main_result]
    seen["table"] = {
        "html": main[0].html if main else None,
        "text": main[0].text if main else None,
        "formats": list(main[0].formats()) if main else [],
    }

    errors = []
    boom = sbx.run_code("def f():\n    return 1 / 0\nf()", on_error=errors.append)
    seen["error"] = {
        "name": boom.error.name if boom.error else None,
        "value": boom.error.value if boom.error else None,
        "traceback": boom.error.traceback if boom.error else None,
        "callback": len(errors),
    }
    seen["after_error"] = sbx.run_code("x").text

    seen["env_once"] = sbx.run_code(
        "import os\nos.environ.get('ONLY_HERE')", envs={"ONLY_HERE": "yes"}
    ).text
    seen["env_after"] = sbx.run_code("repr(os.environ.get('ONLY_HERE'))").text

    # A flood keeps its head (streamed) and its tail (sent at the end), 512 KiB each.
    big = sbx.run_code("print('a' * 1500000 + 'END')")
    joined = "".join(big.logs.stdout)
    seen["flood"] = {
        "length": len(joined),
        "head": joined[:3],
        "end": joined[-4:],
        "marker": "bytes omitted" in joined,
    }

    # `language` picks that language's default context: Python's is the one used so far.
    seen["language_python"] = sbx.run_code("x * 2", language="python").text

    # E2B's contexts start in /home/user (the default one and a new one), shell escapes too.
    seen["cwd"] = {
        "default": "".join(sbx.run_code("import os\nprint(os.getcwd())").logs.stdout).strip(),
        "shell": "".join(sbx.run_code("!pwd").logs.stdout).strip(),
        "created": sbx.create_code_context().cwd,
        "chosen": sbx.create_code_context(cwd="/tmp").cwd,
    }
finally:
    sbx.kill()

# A sandbox killed while a cell runs: the stream is cut, the SDK probes the sandbox's health
# and says it was killed (not a cell that ended normally, not a hang).
doomed = Sandbox.create()
timer = threading.Timer(2.0, doomed.kill)
timer.start()
try:
    doomed.run_code("import time; time.sleep(300)", timeout=120)
    seen["killed_under_cell"] = "returned"
except TimeoutException as e:
    seen["killed_under_cell"] = str(e)
except Exception as e:  # noqa: BLE001 - the test says what came instead
    seen["killed_under_cell"] = "%s: %s" % (type(e).__name__, e)
finally:
    timer.cancel()
    doomed.kill()

print(json.dumps(seen))
