"""Codex CLI, unmodified, through the proxy — opt-in: `GYRE_CODEX=<path to codex> pytest tests/harness/test_codex.py`.

Skipped without `GYRE_CODEX` (install it once, outside the tests: `npm install --prefix DIR @openai/codex`;
recorded passing with codex-cli 0.171.0, see docs/proxy.md). Codex talks to the proxy as a custom provider
(`wire_api = "responses"`, agents/codex/launch.py writes its config) and to nothing else.

- the stock engine: random weights on the local CPU engine (the tiny model, and a checkpoint with a
  Qwen2.5-style chat template) serve Codex's real ~40K-token prompt;
- a scripted session on the stock template and on a checkpoint with a Qwen2.5-style chat template: the model
  calls a function tool (`exec_command`), the freeform `apply_patch` and a namespaced sub-agent tool, and
  Codex runs each (the patch writes hello.txt) and finishes; every echo renders to exactly what the model
  wrote (no drift);
- sub-agents (`spawn_agent`, `wait_agent`) and compaction (above `auto_compact_token_limit`) get their branch
  kinds; the runner earns the toy task's reward with agents/codex/harness.toml, sandboxed.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import pytest

from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
from tests.harness.codex_session import FINAL, run_session, script
from tests.harness.harness_helpers import run_installed_agent
from tests.hf_checkpoint import save_checkpoint
from tests.proxy.scripted_engine import ScriptedEngine, tool_call

CODEX = os.environ.get("GYRE_CODEX")
pytestmark = pytest.mark.skipif(not CODEX, reason="opt-in: set GYRE_CODEX to a codex binary")


def _outputs(session) -> list[list[str]]:
    kinds = []
    for exchange in session.exchanges:
        assert exchange["status"] == 200, exchange["answer"][-2000:]
        final = [json.loads(x[6:]) for x in exchange["answer"].splitlines() if x.startswith("data: ")][-1]
        kinds.append([item["type"] for item in final["response"]["output"]])
    return kinds


@pytest.mark.parametrize("template", ["stock", "qwen2_style"])
def test_codex_runs_tools_through_the_proxy(template: str, tmp_path: Path) -> None:
    assert CODEX
    config = {}
    if template == "stock":
        engine = ScriptedEngine()
        replies = script()
    else:
        checkpoint = save_checkpoint(tmp_path / "ckpt", template)
        config["tokenizer"] = str(checkpoint)
        from gyre.proxy.tokens import TokenCodec

        codec = TokenCodec.load(str(checkpoint))
        engine = ScriptedEngine(codec.tokenizer, codec.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        replies = script(separator="\n", inner="\n")  # the template's layout of a call
    engine.start()
    engine.say(*replies)
    try:
        session = run_session(CODEX, engine.url, tmp_path / "run", **config)
    finally:
        engine.stop()
    report = session.done.stdout[-3000:] + session.done.stderr[-3000:]
    assert session.done.returncode == 0, report
    assert _outputs(session) == [["message", "function_call"], ["custom_tool_call"], ["function_call"], ["message"]]
    assert (session.workspace / "hello.txt").read_text() == "hello\n", report  # Codex applied the model's patch
    assert session.answer.strip() == FINAL
    started = [e for e in session.events.events if e.kind == "model_call_started"]
    finished = [e for e in session.events.events if e.kind == "model_call_finished"]
    assert len(finished) == 4 and all(e.dropped_tools == ["web_search"] for e in started)
    assert [e.parent_call_id for e in finished[1:]] == [e.call_id for e in finished[:-1]]
    assert all(e.drift_tokens == 0 for e in finished), [e.drift_tokens for e in finished]


@pytest.mark.parametrize("model", ["tiny", "qwen2_style"])
def test_codex_on_the_stock_engine(model: str, tmp_path: Path) -> None:
    """Random weights on the local CPU engine — the tiny model, or a checkpoint with its own BPE tokenizer and
    Qwen2.5-style chat template (the proxy renders that template): Codex's real prompt is served (not
    refused) and the model's answers come back; each capped at 16 tokens, so Codex may report the cut reply."""
    assert CODEX
    config: dict[str, object] = {}
    if model == "tiny":
        engine = LocalEngineServer(LocalEngine(LocalEngineConfig(seed=0, num_threads=2)))
    else:
        checkpoint = save_checkpoint(tmp_path / "ckpt", model)
        config["tokenizer"] = str(checkpoint)
        engine = LocalEngineServer(LocalEngine(LocalEngineConfig(model=str(checkpoint), seed=0, num_threads=2)))
    engine.start()
    try:
        session = run_session(CODEX, engine.url, tmp_path / "run", prompt="Reply with one word.", max_tokens_cap=16,
                              **config)
    finally:
        engine.stop()
    report = session.done.stdout[-3000:] + session.done.stderr[-3000:]
    assert session.exchanges and all(e["status"] == 200 for e in session.exchanges), report
    finished = [e for e in session.events.events if e.kind == "model_call_finished"]
    assert finished and all(len(e.output_ids) > 0 for e in finished), report
    assert finished[0].finish_reason in ("stop", "length")
    # the cap cuts every reply: Codex either ends on the text or reports the incomplete response
    assert session.done.returncode == 0 or "max_output_tokens" in report or "ncomplete" in report, report


def test_codex_harness_config_earns_the_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """agents/codex/harness.toml through the runner, sandboxed: the model's patch writes the toy task's answer."""
    assert CODEX
    monkeypatch.setenv("GYRE_CODEX", CODEX)
    patch = "*** Begin Patch\n*** Add File: answer.txt\n+hello\n*** End Patch\n"
    result, events = run_installed_agent("codex", CODEX, [tool_call("apply_patch", {"input": patch}), "Done."],
                                         tmp_path / "executions", "cx-0")
    assert result.status == "completed", result.message
    assert result.reward == 1.0, result
    finished = [e for e in events.events if e.kind == "model_call_finished"]
    assert len(finished) == 2 and finished[1].drift_tokens == 0


def _calls(session) -> list[tuple[str, str | None]]:
    """Each call's branch and its parent's branch (None for a root), in the order they finished."""
    finished = [e for e in session.events.events if e.kind == "model_call_finished"]
    assert all(e.finish_reason == "stop" for e in finished)
    branch = {e.call_id: e.branch for e in finished}
    return [(e.branch, branch[e.parent_call_id] if e.parent_call_id else None) for e in finished]


def test_codex_sub_agent_is_its_own_branch(tmp_path: Path) -> None:
    """The model spawns a sub-agent with Codex's `multi_agent_v1.spawn_agent` and waits for it: the
    sub-agent's calls (same environment message, its own assignment) are recorded as branch `sub-agent`."""
    assert CODEX
    spawned = '<tool_call>{"name": "multi_agent_v1.spawn_agent"'  # a call written, not the tool listed

    def respond(prompt: str) -> str:
        if spawned not in prompt:  # a first call: the main agent's, or the sub-agent's
            if "SUBTASK" in prompt.rsplit("<|im_start|>user", 1)[-1]:
                return "Sub done."
            return tool_call("multi_agent_v1.spawn_agent", {"message": "SUBTASK: say hi"})
        if '<tool_call>{"name": "multi_agent_v1.wait_agent"' not in prompt:
            agent = re.search(r'agent_id\W+([0-9a-f-]{36})', prompt)
            assert agent, prompt[-2000:]
            return tool_call("multi_agent_v1.wait_agent", {"targets": [agent.group(1)], "timeout_ms": 600000})
        return "Main done."

    engine = ScriptedEngine()
    engine.respond = respond
    engine.start()
    try:
        session = run_session(CODEX, engine.url, tmp_path, prompt="Delegate a greeting.")
    finally:
        engine.stop()
    report = session.done.stdout[-3000:] + session.done.stderr[-3000:]
    assert session.done.returncode == 0 and session.answer.strip() == "Main done.", report
    calls = _calls(session)
    assert Counter(calls) == Counter([("main", None), ("sub-agent", None), ("main", "main"), ("main", "main")]), calls


def test_codex_compaction_is_a_summary_branch(tmp_path: Path) -> None:
    """Codex compacts above `auto_compact_token_limit` (its ~40K-token prompt is over 30K): the summary call is
    the main agent's `main-summary`, and the conversation it continues with is a new `main` root."""
    assert CODEX

    def respond(prompt: str) -> str:
        last = prompt.rsplit("<|im_start|>user", 1)[-1]
        if "CONTEXT CHECKPOINT COMPACTION" in last:
            return "Summary: listed the files."
        if '<tool_call>{"name": "exec_command"' not in prompt and "produced a summary" not in prompt:
            return tool_call("exec_command", {"cmd": "ls"})
        return "Done."

    engine = ScriptedEngine()
    engine.respond = respond
    engine.start()
    try:
        session = run_session(CODEX, engine.url, tmp_path, prompt="List the files.", compact_at=30000)
    finally:
        engine.stop()
    report = session.done.stdout[-3000:] + session.done.stderr[-3000:]
    assert session.done.returncode == 0, report
    calls = _calls(session)
    # the summary request drops the tools, so it is a new root too (of the main agent, by its identity)
    first, summary = (e["request"] for e in session.exchanges[:2])
    assert first["tools"] and not summary.get("tools")
    assert calls == [("main", None), ("main-summary", None), ("main", None)], report
