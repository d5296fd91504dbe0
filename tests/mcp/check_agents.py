"""An MCP agent's session management, driven with the official Python MCP client (PyPI
`mcp`) over Streamable HTTP against a real `locker serve` (run by tests/mcp.rs):

    python check_agents.py URL KEY session|network|services

- after a "context reset" (a second client session that knows no ids) sandbox_list finds
  the sandbox by its metadata, process_list finds its background process, snapshot_list
  its snapshot; sandbox_set_ttl moves expires_at; snapshot_delete removes the snapshot;
- sandbox_delete and snapshot_delete are safe to repeat (deleted=false, as their
  idempotent hint promises);
- a `network` argument on sandbox_create and run is passed to the server, which enforces
  it (a machine with egress all has a network interface, one without has only `lo`) and
  validates it as for the API;
- service_start starts a server and returns the URL that reaches it through Locker (fetched
  here), port_list finds it again, and a server that exits or never listens fails clearly;
- the annotations, argument texts and output schemas say what the tools do (ttl cap as
  the API's, process_output's max_output_bytes is the LAST N bytes, exec's output schema
  names every field an ExecResult has).

Every check raises on failure; the last line printed is a JSON summary.
"""

import asyncio
import datetime
import json
import sys

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from check_client import call, check

EXEC_RESULT_FIELDS = {
    "call_id", "exit_code", "signal", "reason", "stdout", "stderr", "stdout_b64", "stderr_b64",
    "stdout_truncated", "stderr_truncated", "stdout_bytes", "stderr_bytes", "output_path",
    "timings", "usage",
}


def client(url, key):
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {key}"})
    return Client(streamable_http_client(url + "/mcp", http_client=http), mode="auto")


def when(s):
    return datetime.datetime.fromisoformat(s.replace("Z", "+00:00"))


async def check_catalogue(c):
    by = {t.name: t for t in (await c.list_tools()).tools}
    for name in ("sandbox_list", "sandbox_set_ttl", "process_list", "snapshot_list", "snapshot_delete"):
        check(name in by, f"the tool {name} exists: {sorted(by)}")
    check(by["sandbox_list"].annotations.read_only_hint is True, "sandbox_list is read-only")
    check(by["snapshot_delete"].annotations.destructive_hint is True, "snapshot_delete is destructive")
    ttl = by["sandbox_create"].input_schema["properties"]["ttl_s"]
    check(ttl["maximum"] == 2592000, f"sandbox_create's ttl_s cap is the API's: {ttl}")
    check(by["sandbox_set_ttl"].input_schema["properties"]["ttl_s"]["maximum"] == 2592000, "set_ttl cap")
    mob = by["process_output"].input_schema["properties"]["max_output_bytes"]["description"]
    check("LAST" in mob and "head and tail" not in mob and "output_path" not in mob,
          f"process_output's max_output_bytes says what it does: {mob}")
    out = by["exec"].output_schema["properties"]
    missing = EXEC_RESULT_FIELDS - set(out)
    check(not missing, f"exec's output schema names every field: missing {sorted(missing)}")
    check({"process_id", "pid"} <= set(out), "and the background ones")
    for t in ("sandbox_create", "run"):
        net = by[t].input_schema["properties"].get("network")
        check(net and net["properties"]["egress"]["enum"] == ["none", "all", "allow"], f"{t} takes network: {net}")
        check("enforce" in net["description"], f"{t}.network says the server enforces it")
    check(by["exec"].annotations.open_world_hint is True, "exec may reach the open world with a network policy")
    check(by["file_read"].annotations.open_world_hint is False, "file tools stay inside")
    return len(by)


async def scenario(url, key):
    summary = {}
    label = {"task": "mcp-agents-check"}
    async with client(url, key) as c:
        summary["tools"] = await check_catalogue(c)
        sb = await call(c, "sandbox_create", {"ttl_s": 2592000, "metadata": label})
        check(when(sb["expires_at"]) - datetime.datetime.now(datetime.timezone.utc) > datetime.timedelta(days=29),
              f"a 30-day ttl is accepted: {sb}")
        other = await call(c, "sandbox_create", {"ttl_s": 600, "metadata": {"task": "something-else"}})
        p = await call(c, "exec", {"sandbox_id": sb["id"], "shell": "sleep 300", "background": True})
        snap = await call(c, "snapshot_create", {"sandbox_id": sb["id"]})
        await call(c, "sandbox_delete", {"sandbox_id": other["id"]})

    # A context reset: a new session that knows only the label.
    async with client(url, key) as c:
        found = await call(c, "sandbox_list", {"metadata": label})
        ids = [s["id"] for s in found["sandboxes"]]
        check(ids == [sb["id"]], f"sandbox_list finds it by metadata: {found}")
        s = found["sandboxes"][0]
        check(s["state"] == "running" and s["metadata"] == label and s["expires_at"] and s["template"],
              f"with state, template, expires_at and metadata: {s}")
        every = await call(c, "sandbox_list", {"state": "running"})
        check(sb["id"] in [x["id"] for x in every["sandboxes"]], f"state filter: {every}")
        check(other["id"] not in [x["id"] for x in every["sandboxes"]], "a deleted one is not running")

        procs = await call(c, "process_list", {"sandbox_id": sb["id"]})
        mine = [x for x in procs["processes"] if x["process_id"] == p["process_id"]]
        check(mine and mine[0]["state"] == "running" and mine[0]["pid"] == p["pid"], f"process_list: {procs}")
        await call(c, "process_kill", {"sandbox_id": sb["id"], "process_id": p["process_id"], "signal": "SIGKILL"})
        await call(c, "process_output", {"sandbox_id": sb["id"], "process_id": p["process_id"], "wait_ms": 10000})
        procs = await call(c, "process_list", {"sandbox_id": sb["id"]})
        mine = [x for x in procs["processes"] if x["process_id"] == p["process_id"]][0]
        check(mine["state"] == "exited" and mine["result"]["reason"] in ("signaled", "killed")
              and "stdout" not in mine["result"], f"an exited process, result without bodies: {mine}")

        t = await call(c, "sandbox_set_ttl", {"sandbox_id": sb["id"], "ttl_s": 120})
        left = when(t["expires_at"]) - datetime.datetime.now(datetime.timezone.utc)
        check(datetime.timedelta(seconds=60) < left <= datetime.timedelta(seconds=121), f"set_ttl: {t}")
        err = await call(c, "sandbox_set_ttl", {"sandbox_id": sb["id"], "ttl_s": 2592001}, expect_error=True)
        check("ttl_s" in err, f"past the cap: {err}")

        snaps = await call(c, "snapshot_list", {"sandbox_id": sb["id"]})
        check([x["id"] for x in snaps["snapshots"]] == [snap["id"]], f"snapshot_list: {snaps}")
        d = await call(c, "snapshot_delete", {"snapshot_id": snap["id"]})
        check(d == {"snapshot_id": snap["id"], "deleted": True}, f"snapshot_delete: {d}")
        d = await call(c, "snapshot_delete", {"snapshot_id": snap["id"]})
        check(d == {"snapshot_id": snap["id"], "deleted": False}, f"snapshot_delete again: {d}")
        snaps = await call(c, "snapshot_list", {})
        check(snap["id"] not in [x["id"] for x in snaps["snapshots"]], f"gone: {snaps}")

        d = await call(c, "sandbox_delete", {"sandbox_id": sb["id"]})
        check(d == {"sandbox_id": sb["id"], "deleted": True}, f"delete: {d}")
        d = await call(c, "sandbox_delete", {"sandbox_id": sb["id"]})
        check(d == {"sandbox_id": sb["id"], "deleted": False}, f"delete again is idempotent: {d}")
        found = await call(c, "sandbox_list", {"metadata": label})
        check(found["sandboxes"] == [], f"nothing left: {found}")
    return summary


async def network(url, key):
    summary = {}
    async with client(url, key) as c:
        err = await call(c, "sandbox_create", {"network": {"egress": "allow"}}, expect_error=True)
        check("network.allow" in err and "bad_request" in err, f"the API's validation: {err}")
        err = await call(c, "sandbox_create", {"network": {"egress": "allow", "allow": ["not a name!"]}},
                         expect_error=True)
        check("bad_request" in err, f"a bad allow entry: {err}")
        sb = await call(c, "sandbox_create", {"network": {"egress": "all"}, "ttl_s": 600})
        try:
            check(sb["network"] == {"egress": "all"}, f"the policy is the sandbox's: {sb}")
            r = await call(c, "exec", {"sandbox_id": sb["id"], "shell": "ls /sys/class/net | sort | tr '\\n' ' '"})
            summary["all"] = r["stdout"].strip()
            check(r["stdout"].split() != ["lo"], f"egress all gives the machine a network: {r}")
        finally:
            await call(c, "sandbox_delete", {"sandbox_id": sb["id"]})
        sb = await call(c, "sandbox_create", {"ttl_s": 600})
        try:
            r = await call(c, "exec", {"sandbox_id": sb["id"], "shell": "ls /sys/class/net | tr '\\n' ' '"})
            check(r["stdout"].split() == ["lo"], f"the default is no network: {r}")
        finally:
            await call(c, "sandbox_delete", {"sandbox_id": sb["id"]})
        r = await call(c, "run", {"volume": "mcp-net-vol", "create_volume": True, "size_mb": 64,
                                  "network": {"egress": "all"}, "commit": "never",
                                  "shell": "ls /sys/class/net | sort | tr '\\n' ' '"})
        check(r["exit_code"] == 0 and r["stdout"].split() != ["lo"], f"a run with egress all: {r}")
        r = await call(c, "run", {"volume": "mcp-net-vol", "commit": "never",
                                  "shell": "ls /sys/class/net | tr '\\n' ' '"})
        check(r["stdout"].split() == ["lo"], f"a run without: {r}")
        summary["run"] = "ok"
    return summary


async def services(url, key):
    """service_start runs a server and hands back a URL that reaches it through Locker;
    port_list finds it again; a server that exits or never listens fails clearly."""
    summary = {}
    async with client(url, key) as c:
        by = {t.name: t for t in (await c.list_tools()).tools}
        check(by["port_list"].annotations.read_only_hint is True, "port_list is read-only")
        check("localhost" in by["service_start"].description, "service_start says how to reach it inside")
        sid = (await call(c, "sandbox_create", {"ttl_s": 600}))["id"]
        try:
            await call(c, "file_write", {"sandbox_id": sid, "path": "/root/site/index.html", "content": "hello service"})
            s = await call(c, "service_start", {"sandbox_id": sid, "port": 8000, "cwd": "/root/site",
                                                "shell": "python3 -m http.server 8000 --bind 0.0.0.0"})
            check(s["url"] == f"{url}/v1/sandboxes/{sid}/ports/8000/", f"service_start's url: {s}")
            http = create_mcp_http_client(headers={"Authorization": f"Bearer {key}"})
            async with http:
                r = await http.get(s["url"] + "index.html")
            check(r.status_code == 200 and r.text == "hello service", f"the URL reaches the server: {r.status_code} {r.text[:200]}")
            ports = (await call(c, "port_list", {"sandbox_id": sid}))["ports"]
            check(any(p["port"] == 8000 and p["url"] == s["url"] for p in ports), f"port_list: {ports}")
            summary["again"] = await call(c, "service_start", {"sandbox_id": sid, "port": 8000, "shell": "sleep 1"}, expect_error=True)
            summary["exits"] = await call(c, "service_start", {"sandbox_id": sid, "port": 9000, "shell": "exit 5"}, expect_error=True)
            summary["silent"] = await call(c, "service_start", {"sandbox_id": sid, "port": 9001, "shell": "sleep 60", "wait_s": 2}, expect_error=True)
            summary["waited_ms"] = s["waited_ms"]
        finally:
            await call(c, "sandbox_delete", {"sandbox_id": sid})
    return summary


async def main():
    url, key, what = sys.argv[1], sys.argv[2], sys.argv[3]
    run = {"session": scenario, "network": network, "services": services}[what]
    summary = await run(url, key)
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
