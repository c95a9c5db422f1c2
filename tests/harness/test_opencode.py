"""opencode, unmodified, through the proxy — opt-in: `GYRE_OPENCODE=<opencode> pytest tests/harness/test_opencode.py`.

Skipped without `GYRE_OPENCODE` (install it once, outside the tests: `npm install --prefix DIR opencode-ai`;
recorded passing with opencode 1.18.33, see docs/proxy.md). agents/opencode/launch.py writes its config: a
provider at the proxy through the AI SDK package opencode bundles, over Chat Completions or the Responses
API, with nothing fetched from the network. A scripted model delegates to a sub-agent (opencode's `task`
tool), whose shell call writes the answer; opencode compacts near a small context (branch `main-summary`);
the runner test earns the toy task's reward, sandboxed.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from agents.opencode.launch import OFFLINE, write_config
from gyre.proxy import Proxy, ProxyConfig, ProxyServer
from gyre.proxy.branches import OPENCODE_SUMMARY_REQUEST
from gyre.sink import MemorySink
from tests.harness.codex_session import Relay
from tests.harness.harness_helpers import run_installed_agent
from tests.proxy.scripted_engine import ScriptedEngine, tool_call

OPENCODE = os.environ.get("GYRE_OPENCODE")
pytestmark = pytest.mark.skipif(not OPENCODE, reason="opt-in: set GYRE_OPENCODE to an opencode binary")


WRITE = tool_call("bash", {"command": "printf hello > answer.txt", "description": "Write the answer"})


def run_opencode(engine: ScriptedEngine, tmp_path: Path, prompt: str, api: str = "chat",
                 context: int | None = None) -> tuple[subprocess.CompletedProcess[str], list, MemorySink, Path]:
    """`opencode run PROMPT` through a recording relay and a proxy in front of `engine`."""
    assert OPENCODE
    events = MemorySink()
    server = ProxyServer(Proxy(ProxyConfig(engines={"cell0": engine.url}), sink=events))
    server.start()
    relay = Relay(server.url)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    try:
        token = server.register_execution("oc-1").token
        home, workspace = tmp_path / "home", tmp_path / "workspace"
        workspace.mkdir(parents=True)
        write_config(home, base_url=f"{relay.url}/v1", model="gyre-policy", api=api, context=context)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "OPENAI_API_KEY": token,
               **OFFLINE, "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
               "NO_PROXY": "127.0.0.1,localhost"}  # a closed port: nothing leaves the machine
        done = subprocess.run([OPENCODE, "run", prompt], cwd=workspace, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    finally:
        relay.shutdown()
        server.stop()
        engine.stop()
    return done, relay.exchanges, events, workspace


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_opencode_delegates_to_a_sub_agent_through_the_proxy(api: str, tmp_path: Path) -> None:
    engine = ScriptedEngine()
    engine.start()
    engine.say(tool_call("task", {"description": "Write answer", "prompt": "Write hello into answer.txt.",
                             "subagent_type": "general"}),
               WRITE, "Written.", "Done.")
    done, exchanges, events, workspace = run_opencode(engine, tmp_path, "Delegate writing hello into answer.txt.",
                                                      api)
    report = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, report
    path = "/v1/chat/completions" if api == "chat" else "/v1/responses"
    assert [(e["path"], e["status"]) for e in exchanges] == [(path, 200)] * 4, report
    assert (workspace / "answer.txt").read_text() == "hello"
    finished = [e for e in events.events if e.kind == "model_call_finished"]
    assert [e.branch for e in finished] == ["main", "sub-agent", "sub-agent", "main"], report
    assert finished[2].parent_call_id == finished[1].call_id and finished[3].parent_call_id == finished[0].call_id


def test_opencode_compaction_is_a_summary_branch(tmp_path: Path) -> None:
    """opencode compacts near the context it is told (36K; its prompt is ~31K byte-level tokens): a long tool
    output pushes it over, its summary request (the conversation quoted in one message) is `main-summary`
    and the conversation it continues with is a new `main` root."""

    def respond(prompt: str) -> str:
        last = prompt.rsplit("<|im_start|>user", 1)[-1]
        if OPENCODE_SUMMARY_REQUEST in last:
            return "Summary: counted."
        if "Continue if you have next steps" in last:
            return "Done."
        written = prompt.count('<tool_call>{"name": "bash"')  # calls the model wrote (the tool list has none)
        if written == 0:
            return tool_call("bash", {"command": "seq 1 3000", "description": "Count"})
        return tool_call("bash", {"command": "ls", "description": "List"}) if written == 1 else "Done."

    engine = ScriptedEngine()
    engine.respond = respond
    engine.start()
    done, _, events, _ = run_opencode(engine, tmp_path, "Count to 3000.", context=36000)
    report = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, report
    finished = [e for e in events.events if e.kind == "model_call_finished"]
    branch = {e.call_id: e.branch for e in finished}
    calls = [(e.branch, branch.get(e.parent_call_id or "")) for e in finished]
    assert calls == [("main", None), ("main", "main"), ("main-summary", None), ("main", None)], report


def test_opencode_harness_config_earns_the_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """agents/opencode/harness.toml through the runner, sandboxed: the model's shell call writes the answer."""
    assert OPENCODE
    monkeypatch.setenv("GYRE_OPENCODE", OPENCODE)
    result, events = run_installed_agent("opencode", OPENCODE, [WRITE, "Done."], tmp_path / "executions", "oc-0")
    assert result.status == "completed", result.message
    assert result.reward == 1.0, result
    assert len([e for e in events.events if e.kind == "model_call_finished"]) == 2
