"""Drives E2B's unmodified `e2b-code-interpreter` SDK's contexts against Locker: create,
list, run in, restart, remove; a context stays in its sandbox; a client timeout interrupts
the cell and the context keeps its state; and the protocol's refusals on the raw wire.
Prints what it saw as one JSON line for tests/e2b_interp.rs.

Environment: E2B_API_URL and E2B_SANDBOX_URL (Locker's URL), E2B_API_KEY (a Locker key).
"""

import json
import os
import time

import httpx
from e2b import NotFoundException, TimeoutException
from e2b_code_interpreter import Sandbox

URL = os.environ["E2B_SANDBOX_URL"]
seen = {}


def raw(sbx, method, path, token=None, traffic=None, body=None):
    """A request to the sandbox's port 49999 as the SDK sends it, with chosen tokens."""
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    if token is not None:
        headers["X-Access-Token"] = token
    if traffic is not None:
        headers["E2B-Traffic-Access-Token"] = traffic
    r = httpx.request(method, URL + path, headers=headers, json=body, timeout=120)
    return {"status": r.status_code, "text": r.text}


a = Sandbox.create()
b = Sandbox.create()
try:
    ctx = a.create_code_context(cwd="/tmp")
    seen["created"] = {"id": ctx.id, "language": ctx.language, "cwd": ctx.cwd}
    seen["cwd"] = a.run_code("import os\nos.getcwd()", context=ctx).text
    a.run_code("y = 'in the context'", context=ctx)
    seen["kept"] = a.run_code("y", context=ctx).text
    seen["apart"] = a.run_code("'y' in globals()").text
    seen["listed"] = sorted(c.id for c in a.list_code_contexts())

    # A context of sandbox a is nobody's in sandbox b.
    try:
        b.run_code("1", context=ctx)
        seen["other_sandbox"] = "ran"
    except NotFoundException as e:
        seen["other_sandbox"] = "not found: %s" % e
    seen["b_listed"] = [c.id for c in b.list_code_contexts()]

    a.restart_code_context(ctx)
    after = a.run_code("y", context=ctx)
    seen["after_restart"] = after.error.name if after.error else after.text

    # A client that stops waiting: the server interrupts the kernel, the state stays.
    a.run_code("z = 5", context=ctx)
    started = time.monotonic()
    try:
        a.run_code("import time\nwhile True:\n    time.sleep(0.1)", context=ctx, timeout=3)
        seen["timeout"] = "returned"
    except TimeoutException as e:
        seen["timeout"] = "raised: %s" % e
    seen["timeout_s"] = round(time.monotonic() - started, 1)
    started = time.monotonic()
    seen["after_timeout"] = a.run_code("z", context=ctx, timeout=60).text
    seen["after_timeout_s"] = round(time.monotonic() - started, 1)

    a.remove_code_context(ctx.id)
    seen["listed_after_remove"] = sorted(c.id for c in a.list_code_contexts())
    try:
        a.run_code("1", context=ctx)
        seen["removed"] = "ran"
    except NotFoundException as e:
        seen["removed"] = "not found: %s" % e
    try:
        a.restart_code_context(ctx)
        seen["restart_removed"] = "restarted"
    except NotFoundException:
        seen["restart_removed"] = "not found"

    # The wire: running code needs the access token; a wrong one opens nothing.
    token = a._envd_access_token
    seen["raw"] = {
        "execute_without_token": raw(a, "POST", "/execute", body={"code": "1"}),
        "execute_wrong_token": raw(a, "POST", "/execute", token="nope", body={"code": "1"}),
        "execute_b_token": raw(b, "POST", "/execute", token=token, body={"code": "1"}),
        "contexts_wrong_token": raw(a, "GET", "/contexts", traffic="nope"),
        "contexts_without_token": raw(a, "GET", "/contexts"),
        "contexts_traffic_token": raw(a, "GET", "/contexts", traffic=token),
        "both": raw(a, "POST", "/execute", token=token,
                    body={"code": "1", "context_id": "ctx_x", "language": "python"}),
        "no_code": raw(a, "POST", "/execute", token=token, body={"language": "python"}),
        "no_such_language": raw(a, "POST", "/execute", token=token,
                                body={"code": "1", "language": "cobol"}),
        "health": raw(a, "GET", "/health"),
        "unknown_route": raw(a, "GET", "/kernels"),
        "execute": raw(a, "POST", "/execute", token=token, body={"code": "40 + 2"}),
    }
finally:
    a.kill()
    b.kill()

print(json.dumps(seen))
