"""mini-swe-agent, unmodified, in the sandbox: through the real proxy, its bash tool acting in the workspace.

Skipped unless `mini` is found ($GYRE_MINI or PATH): it is not a dependency (litellm and its tree are large).
Its own environment (a venv outside the checkout) is bound read-only with `ro_mounts`, the way a toolchain
is. The engine is scripted, so the agent's two turns are known: write the answer with its bash tool, then
submit. Run it here with `GYRE_MINI=/path/to/venv/bin/mini pytest tests/harness/test_mini_swe_agent.py`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gyre.events.models import ModelCallFinished
from gyre.harness import Execution, HarnessConfig, HarnessRunner
from gyre.proxy import Proxy, ProxyConfig, ProxyServer
from gyre.sink import MemorySink
from tests.harness.harness_helpers import make_task
from tests.proxy.scripted_engine import ScriptedEngine, tool_call

MINI = os.environ.get("GYRE_MINI") or shutil.which("mini")
pytestmark = pytest.mark.skipif(MINI is None, reason="mini-swe-agent (`mini`) is not installed; set GYRE_MINI")
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def bash(command: str) -> str:
    """What the scripted model says: one call of mini's `bash` tool, in the chat template's tool-call syntax."""
    return tool_call("bash", {"command": command})


def test_mini_swe_agent_solves_a_task_in_the_sandbox(tmp_path: Path) -> None:
    assert MINI is not None
    venv = Path(MINI).resolve().parent.parent  # its interpreter and packages, bound read-only
    engine = ScriptedEngine()
    engine.start()
    engine.say(bash("printf hello > answer.txt"), bash(SUBMIT))
    calls = MemorySink()
    server = ProxyServer(Proxy(ProxyConfig(engines={"cell0": engine.url}), sink=calls))
    server.start()
    config = HarnessConfig(
        name="mini-swe-agent", timeout_s=300, ro_mounts=[str(venv)],
        command=[MINI, "-t", "{prompt}", "--yolo", "--exit-immediately", "-o", "{home}/trajectory.json",
                 "-c", "mini.yaml", "-c", "model.model_name=hosted_vllm/gyre-policy",
                 "-c", "model.model_kwargs.api_base={openai_base_url}", "-c", "model.cost_tracking=ignore_errors",
                 "-c", "agent.step_limit=5"],
        env={"HOSTED_VLLM_API_KEY": "{token}", "MSWEA_CONFIGURED": "true"})
    try:
        token = server.register_execution("mini-0", None).token
        with HarnessRunner(config, sink=MemorySink(), proxy_url=server.url, root=tmp_path / "executions") as runner:
            result = runner.run(Execution("mini-0", make_task(), "g0", token=token, cell_id="cell0"))
    finally:
        server.stop()
        engine.stop()
    said = result.dirs.stdout.read_text() + result.dirs.stderr.read_text()
    assert result.status == "completed", said[-3000:]
    assert result.reward == 1.0, said[-3000:]  # its bash tool wrote the answer in the workspace
    assert len([e for e in calls.events if isinstance(e, ModelCallFinished)]) == 2
    assert (result.dirs.home / "trajectory.json").exists()  # mini saved its run in its own home
