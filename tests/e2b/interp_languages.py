"""Drives E2B's unmodified `e2b-code-interpreter` SDK through the languages of E2B's
code-interpreter template against Locker's: JavaScript and TypeScript (Locker's kernel on
Node), R (IRkernel), Java (Locker's kernel on JShell) and bash (Locker's kernel), as E2B's
own suites call them (`test_default_kernels`, `env_vars/*`, `test_cwd`, `test_contexts`),
and a bit further (state, errors, a timeout that interrupts). Prints what it saw as one
JSON line for tests/e2b_interp.rs.

Environment: E2B_API_URL and E2B_SANDBOX_URL (Locker's URL), E2B_API_KEY (a Locker key).
"""

import json
import time

from e2b_code_interpreter import Sandbox

seen = {}


def done_with(sbx, language):
    """Removes the contexts of `language`: their kernels end (a 512 MB sandbox does not hold
    every language's kernel at once: a JVM with JShell takes about 250 MB)."""
    for c in sbx.list_code_contexts():
        if c.language == language:
            sbx.remove_code_context(c.id)


def cell(execution):
    """What one execution gave, in plain data."""
    return {
        "stdout": execution.logs.stdout,
        "stderr": execution.logs.stderr,
        "text": execution.text,
        "results": [r.text for r in execution.results],
        "error": None
        if execution.error is None
        else {"name": execution.error.name, "value": execution.error.value},
    }


sbx = Sandbox.create(envs={"TEST_ENV_VAR": "supertest"})
try:
    # E2B's server starts a Python and a JavaScript context with the sandbox.
    seen["listed"] = [c.language for c in sbx.list_code_contexts()]

    js = {}
    js["hello"] = cell(sbx.run_code("console.log('Hello, World!')", language="js"))
    js["esm"] = cell(
        sbx.run_code(
            "\n    import { readFileSync } from 'fs'\n    console.log(typeof readFileSync)\n    ",
            language="js",
        )
    )
    js["await"] = cell(sbx.run_code("\n    await Promise.resolve('Hello World!')\n    ", language="js"))
    js["cwd"] = cell(sbx.run_code("process.cwd()", language="js"))
    js["sandbox_env"] = cell(sbx.run_code("process.env.TEST_ENV_VAR", language="javascript"))
    js["cell_env"] = cell(
        sbx.run_code("process.env.FOO", envs={"FOO": "bar"}, language="javascript")
    )
    js["cell_env_after"] = cell(
        sbx.run_code("process.env.FOO || 'default'", language="javascript")
    )
    sbx.run_code("const x = 41", language="js")
    js["state"] = cell(sbx.run_code("x + 1", language="js"))
    js["error"] = cell(sbx.run_code("undefinedName", language="js"))
    js["object"] = cell(sbx.run_code("({ a: 1, b: [1, 2] })", language="js"))
    started = time.monotonic()
    try:
        sbx.run_code("while (true) {}", language="js", timeout=3)
        js["timeout"] = "returned"
    except Exception as e:
        js["timeout"] = "raised: %s" % type(e).__name__
    js["after_timeout"] = cell(sbx.run_code("x", language="js"))
    js["after_timeout_s"] = time.monotonic() - started
    seen["js"] = js
    done_with(sbx, "javascript")

    seen["ts"] = cell(
        sbx.run_code(
            "const message: string = 'Hello, World!'; console.log(message)", language="ts"
        )
    )
    seen["ts_types"] = cell(
        sbx.run_code(
            "interface P { n: number }\nconst p: P = { n: 2 }\np.n * 21", language="ts"
        )
    )

    done_with(sbx, "typescript")
    seen["r"] = {
        "hello": cell(sbx.run_code('print("Hello, World!")', language="r")),
        "sandbox_env": cell(sbx.run_code("Sys.getenv('TEST_ENV_VAR')", language="r")),
        "cell_env": cell(sbx.run_code("Sys.getenv('FOO')", envs={"FOO": "bar"}, language="r")),
        "cell_env_after": cell(
            sbx.run_code("Sys.getenv('FOO', unset = 'default')", language="r")
        ),
    }

    done_with(sbx, "r")
    seen["java"] = {
        "hello": cell(sbx.run_code('System.out.println("Hello, World!")', language="java")),
        "sandbox_env": cell(
            sbx.run_code('System.getProperty("TEST_ENV_VAR")', language="java")
        ),
        "cell_env": cell(
            sbx.run_code('System.getProperty("FOO")', envs={"FOO": "bar"}, language="java")
        ),
        "cell_env_after": cell(
            sbx.run_code('System.getProperty("FOO", "default")', language="java")
        ),
        "error": cell(sbx.run_code("int q = 1 / 0;", language="java")),
    }

    done_with(sbx, "java")
    seen["bash"] = {
        "sandbox_env": cell(sbx.run_code("echo $TEST_ENV_VAR", language="bash")),
        "cell_env": cell(sbx.run_code("echo $FOO", envs={"FOO": "bar"}, language="bash")),
        "cell_env_after": cell(sbx.run_code("echo ${FOO:-default}", language="bash")),
        "pwd": cell(sbx.run_code("pwd", language="bash")),
    }
    seen["listed_after"] = sorted(c.language for c in sbx.list_code_contexts())

    # E2B's chart and DataFrame extensions, as the SDK parses them.
    bar = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [1, 2])\nplt.title('T')\nplt.show()"
    )
    chart = bar.results[0].chart
    seen["chart"] = {
        "type": str(getattr(chart.type, "value", chart.type)),
        "title": chart.title,
        "labels": [e.label for e in chart.elements],
        "values": [e.value for e in chart.elements],
        "png": bool(bar.results[0].png),
    }
    table = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    seen["data"] = table.results[0].data
finally:
    sbx.kill()

print(json.dumps(seen))
