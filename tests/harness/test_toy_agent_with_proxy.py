"""The toy agent through the real proxy: its compaction and sub-agent calls get the right branch kinds, and
a random-init model on the local CPU engine yields graded rewards through the whole chain.

Optional integration: skipped when the proxy (another package, still moving) cannot be imported.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gyre.events.models import ModelCallFinished, RewardRecorded
from gyre.harness import Execution, HarnessConfig, HarnessRunner, TaskSet
from gyre.sink import MemorySink
from tests.harness.harness_helpers import TOY_HARNESS, TOY_TASKS

proxy = pytest.importorskip("gyre.proxy")
scripted_engine = pytest.importorskip("tests.proxy.scripted_engine")
local_engine = pytest.importorskip("gyre.engine.local")
call = scripted_engine.tool_call


def serve(engine_url: str) -> tuple[object, object]:
    calls = MemorySink()
    server = proxy.ProxyServer(proxy.Proxy(proxy.ProxyConfig(engines={"cell0": engine_url}), sink=calls))
    server.start()
    return server, calls


@pytest.fixture
def engine() -> Iterator[object]:
    engine = scripted_engine.ScriptedEngine()
    engine.start()
    yield engine
    engine.stop()


def run(server: object, task_ids: list[str], tmp_path: Path) -> tuple[list[object], MemorySink]:
    tasks = TaskSet.load(TOY_TASKS)
    sink = MemorySink()
    executions = [Execution(f"e{i}", tasks[t], "g0", token=server.register_execution(f"e{i}", None).token,
                            cell_id="cell0") for i, t in enumerate(task_ids)]
    with HarnessRunner(HarnessConfig.load(TOY_HARNESS), sink=sink, proxy_url=server.url,
                       root=tmp_path / "executions") as runner:
        return runner.run_group(executions), sink


def test_branch_kinds_of_subagent_and_compaction_calls(engine: object, tmp_path: Path) -> None:
    engine.say(call("delegate", {"task": "write draft.txt"}),                       # main
               call("write_file", {"path": "draft.txt", "content": "draft"}),       # sub-agent
               "draft written",                                                      # sub-agent
               call("read_file", {"path": "draft.txt"}),                             # main
               call("run", {"command": "ls"}),                                       # main, third turn
               "Summary: a sub-agent wrote draft.txt.",                              # main-summary
               "hello")                                                              # main, continued
    server, calls = serve(engine.url)
    try:
        [result], _ = run(server, ["hello"], tmp_path)
    finally:
        server.stop()
    assert result.status == "completed", result.message
    assert result.reward == 1.0
    finished = [e for e in calls.events if isinstance(e, ModelCallFinished)]
    assert [e.branch for e in finished] == ["main", "sub-agent", "sub-agent", "main", "main", "main-summary",
                                            "main"]
    assert finished[2].parent_call_id == finished[1].call_id  # the sub-agent's second call extends its first
    assert finished[-1].parent_call_id is None  # the continuation starts a new root...
    assert finished[4].parent_call_id == finished[3].call_id  # ...while main's turns extend each other


def test_a_group_on_the_random_local_model_earns_varied_graded_rewards(tmp_path: Path) -> None:
    """Four executions of one task, as a GSPO group samples them. The prompts are identical and the engine's
    request seeds come from its own seeded generator, so the multiset of rewards is reproducible."""
    engine = local_engine.LocalEngineServer(local_engine.LocalEngine(local_engine.LocalEngineConfig(seed=0)))
    engine.start()
    server, calls = serve(engine.url)
    try:
        results, sink = run(server, ["hello"] * 4, tmp_path)
    finally:
        server.stop()
        engine.stop()
    assert [r.status for r in results] == ["completed"] * 4
    rewards = [e.reward for e in sink.of(RewardRecorded)]
    assert len(rewards) == 4 and all(0.0 <= r < 1.0 for r in rewards)
    assert len(set(rewards)) > 1 and any(r > 0 for r in rewards)  # a spread for the group advantage
    finished = [e for e in calls.events if isinstance(e, ModelCallFinished)]
    assert {e.execution_id for e in finished} == {"e0", "e1", "e2", "e3"} and all(e.output_ids for e in finished)
