"""The OpenAI Agents SDK's sandbox provider backed by Locker (`locker.openai_agents`): the
real `openai-agents` package runs a SandboxAgent, driven by its own ScriptedModel (no model
API is reachable here), whose shell runs in a Locker sandbox made from the manifest (files
written, environment set), and the run deletes the sandbox. Skipped where `openai-agents`
is not installed (tests/python_sdk.rs installs it when PyPI is reachable)."""

import asyncio
import json
import os

import pytest

agents = pytest.importorskip("agents")

from agents import Runner  # noqa: E402
from agents.run import RunConfig  # noqa: E402
from agents.sandbox import Dir, Manifest, SandboxAgent, SandboxRunConfig  # noqa: E402
from agents.sandbox.capabilities.shell import Shell  # noqa: E402
from agents.sandbox.entries import File  # noqa: E402
from agents.sandbox.manifest import Environment  # noqa: E402
from agents.testing import ScriptedModel, assistant_message, function_call  # noqa: E402

from locker import Client, LockerError  # noqa: E402
from locker.openai_agents import LockerSandboxClient, LockerSandboxClientOptions  # noqa: E402


def _outputs(call):
    """The function call outputs the model was sent."""
    items = call.input if isinstance(call.input, list) else []
    out = []
    for i in items:
        d = i if isinstance(i, dict) else getattr(i, "model_dump", lambda: {})()
        if d.get("type") == "function_call_output":
            out.append(d.get("output") if isinstance(d.get("output"), str) else json.dumps(d.get("output")))
    return out


def test_a_sandbox_agent_runs_its_shell_in_a_locker_sandbox(client):
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    model = ScriptedModel([
        [function_call("exec_command", {"cmd": "pwd && cat notes/readme.txt && echo $GREETING && python3 -c 'print(6*7)'"}, call_id="c1")],
        [assistant_message("done")],
    ])
    manifest = Manifest(root="/work/py-agent",
                        entries={"notes": Dir(children={"readme.txt": File(content=b"from the manifest\n")})},
                        environment=Environment(value={"GREETING": "hi"}))
    agent = SandboxAgent(name="locker-py", model=model, instructions="Work in the sandbox.",
                         default_manifest=manifest, capabilities=[Shell()])
    sandboxes = LockerSandboxClient(client)
    before = {s.id for s in client.sandboxes.list()}
    result = asyncio.run(Runner.run(agent, "Look around.", run_config=RunConfig(sandbox=SandboxRunConfig(
        client=sandboxes, options=LockerSandboxClientOptions(metadata={"suite": "py-openai-agents"})))))
    assert result.final_output == "done"
    out = "\n".join(_outputs(model.calls[-1]))
    assert "/work/py-agent\nfrom the manifest\nhi\n42" in out, out
    left = [s.id for s in client.sandboxes.list(suite="py-openai-agents") if s.id not in before]
    assert left == [], "the run deleted the sandbox it made"


def test_sessions_persist_and_hydrate_the_workspace_as_tar(client):
    sandboxes = LockerSandboxClient(client)

    async def go():
        s = await sandboxes.create(manifest=Manifest(root="/work/ws"), options=LockerSandboxClientOptions())
        inner = s._inner
        try:
            await inner._prepare_backend_workspace()
            import io
            await inner.write("a.txt", io.BytesIO(b"one\n"))
            assert (await inner.read("a.txt")).read() == b"one\n"
            with pytest.raises(FileNotFoundError):
                await inner.read("missing.txt")
            tar = (await inner.persist_workspace()).read()
            assert b"a.txt" in tar and b"one\n" in tar
            await inner.write("a.txt", io.BytesIO(b"changed\n"))
            await inner.hydrate_workspace(io.BytesIO(tar))
            assert (await inner.read("/work/ws/a.txt")).read() == b"one\n"
            r = await inner._exec_internal("sh", "-c", "cat /work/ws/a.txt; exit 3")
            assert (r.stdout, r.exit_code) == (b"one\n", 3)
            assert await inner.running() is True
            again = await sandboxes.resume(inner.state)
            assert again._inner.sandbox.id == inner.sandbox.id
        finally:
            await sandboxes.delete(s)
        assert await inner.running() is False

    asyncio.run(go())
