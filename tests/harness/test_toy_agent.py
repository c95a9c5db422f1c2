"""The toy agent end to end against a scripted stand-in server: retries, malformed calls, the sub-agent,
compaction and the plain-text fallback all happen; and the agent imports nothing of Gyre."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gyre.events.models import ExecutionFinished, RewardRecorded
from gyre.harness import HarnessConfig, HarnessRunner, TaskSet
from gyre.sink import MemorySink
from tests.conftest import HANG_S, Threads
from tests.harness.harness_helpers import REPO, TOKEN, TOY_HARNESS, TOY_TASKS, execution
from tests.harness.stand_in_server import Script, StandInServer, error, text, tool

AGENT_DIR = REPO / "agents" / "toy_agent"
CONTINUATION_MARKER = "This session is being continued from a previous conversation"


@pytest.fixture
def server() -> Iterator[StandInServer]:
    server = StandInServer(Script()).start()
    yield server
    server.stop()


def run_toy(server: StandInServer, tmp_path: Path, task_id: str, **config: Any) -> tuple[Any, MemorySink]:
    """One execution of the shipped toy harness config on a toy task, pointed at the stand-in server."""
    sink = MemorySink()
    harness = HarnessConfig.load(TOY_HARNESS).model_copy(update=config)
    with HarnessRunner(harness, sink=sink, proxy_url=server.url, root=tmp_path / "executions") as runner:
        result = runner.run(execution(TaskSet.load(TOY_TASKS)[task_id]))
    return result, sink


def agent_report(result: Any) -> dict[str, Any]:
    return json.loads(result.dirs.stdout.read_text().strip().splitlines()[-1])


def test_the_agent_imports_only_the_standard_library_and_the_sdk() -> None:
    siblings = {p.stem for p in AGENT_DIR.glob("*.py")}
    allowed = set(sys.stdlib_module_names) | {"openai", "anthropic"} | siblings
    for path in AGENT_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                top = name.split(".")[0]
                assert top != "gyre" and top in allowed, f"{path.name} imports {name}"


@pytest.mark.parametrize("client", ["sdk", "http"])
def test_end_to_end_retry_malformed_call_subagent_compaction_and_fallback(server: StandInServer,
                                                                          tmp_path: Path, client: str) -> None:
    server.script.main = deque([
        error(500),                                                     # retried with backoff
        tool("write_file", '{"path": "answer.txt", "content": '),       # malformed: error result, next turn
        tool("delegate", {"task": "write draft.txt"}),                  # the sub-agent
        tool("read_file", {"path": "draft.txt"}),                      # third turn: compaction follows
        text("hello"),                                                  # no tool call: the fallback writes it
    ])
    server.script.sub = deque([tool("write_file", {"path": "draft.txt", "content": "draft"}), text("draft written")])
    server.script.summary = "Summary: a sub-agent wrote draft.txt."
    command = (*HarnessConfig.load(TOY_HARNESS).command, "--client", client)
    result, sink = run_toy(server, tmp_path, "hello", command=command)

    assert result.status == "completed", result.message
    assert result.reward == 1.0 and (result.workspace / "answer.txt").read_text() == "hello"
    assert (result.workspace / "draft.txt").read_text() == "draft"
    report = agent_report(result)
    assert report | {"duration_s": 0} == report | {
        "stop_reason": "answer", "is_error": False, "answer_written_by": "fallback", "api_retries": 1,
        "malformed_tool_calls": 1, "subagents": 1, "compactions": 1, "turns": 6, "model_calls": 8,
        "duration_s": 0}
    assert {s.authorization for s in server.seen} == {f"Bearer {TOKEN}"}  # the env reached the client

    main, sub, summary = server.requests("main"), server.requests("sub"), server.requests("summary")
    assert len(main) == 5 and len(sub) == 2 and len(summary) == 1
    assert main[0] == main[1]  # the retry repeats the failed request
    assert main[0]["messages"][1] == {"role": "user", "content": "Write the word hello into answer.txt."}
    assert {t["function"]["name"] for t in main[0]["tools"]} == {"write_file", "read_file", "run", "delegate"}
    malformed_result = main[2]["messages"][-1]
    assert malformed_result["role"] == "tool" and "malformed tool call" in malformed_result["content"]

    # The sub-agent has its own conversation and cannot delegate further.
    assert sub[0]["messages"][0]["role"] == "system" and len(sub[0]["messages"]) == 2
    assert sub[0]["messages"][1]["content"].endswith("write draft.txt")
    assert "delegate" not in {t["function"]["name"] for t in sub[0]["tools"]}
    assert main[3]["messages"][-1]["content"] == "sub-agent finished (answer): draft written"

    # Compaction: the summary call sees the whole conversation, then the agent continues from the summary.
    request = summary[0]["messages"]
    assert "tools" not in summary[0]
    assert request[:len(main[3]["messages"])] == main[3]["messages"]
    assert [m["role"] for m in request[len(main[3]["messages"]):]] == ["assistant", "tool", "user"]
    assert request[-2]["content"] == "draft" and request[-1]["content"].startswith("Your task is to create a detailed")
    fresh = main[4]["messages"]
    assert [m["role"] for m in fresh] == ["system", "user"]
    assert fresh[1]["content"].startswith(CONTINUATION_MARKER)
    assert "Summary: a sub-agent wrote draft.txt." in fresh[1]["content"]
    assert "Write the word hello into answer.txt." in fresh[1]["content"]

    kinds = [e.kind for e in sink.events]
    assert kinds == ["execution_queued", "execution_started", "execution_finished", "reward_recorded"]


def test_plain_text_from_the_start_earns_graded_credit(server: StandInServer, tmp_path: Path) -> None:
    server.script.main = deque([text("def add(a, b):\n    return a - b\n")])
    result, sink = run_toy(server, tmp_path, "add")
    assert result.status == "completed"
    assert (result.workspace / "solution.py").read_text() == "def add(a, b):\n    return a - b\n"
    [reward] = sink.of(RewardRecorded)
    assert 0.0 < reward.reward < 1.0 and json.loads(reward.details)["checks_passed"] == 1
    assert agent_report(result)["answer_written_by"] == "fallback"


@pytest.mark.parametrize("call", [("write_file", {"path": "answer.txt", "content": "hello"}),
                                  ("run", {"command": "echo hello > answer.txt"})], ids=["write_file", "run"])
def test_a_file_written_by_a_tool_is_not_overwritten_by_the_final_text(server: StandInServer, tmp_path: Path,
                                                                       call: tuple[str, dict[str, str]]) -> None:
    server.script.main = deque([tool(*call), text("Done: hello")])  # a command's file counts too (#29's sums)
    result, _ = run_toy(server, tmp_path, "hello")
    assert result.reward == 1.0 and agent_report(result)["answer_written_by"] == "tool"


def test_an_env_gate_holds_the_execution_until_its_file_exists(server: StandInServer, tmp_path: Path) -> None:
    """`--env-gate FILE`: after a model reply the agent waits until FILE exists, seen inside the sandbox through
    `ro_mounts` (how tests/cluster/test_multihost_netns.py keeps a run from ending before a replacement cell
    registers)."""
    gate_dir = tmp_path / "gate"
    gate_dir.mkdir()
    server.script.main = deque([tool("run", {"command": "echo hi"}), text("hello")])
    harness = HarnessConfig.load(TOY_HARNESS)
    harness = harness.model_copy(update={"command": (*harness.command, "--env-gate", str(gate_dir / "open")),
                                         "ro_mounts": (str(gate_dir),)})
    results: list[Any] = []

    def run() -> None:
        with HarnessRunner(harness, sink=MemorySink(), proxy_url=server.url, root=tmp_path / "executions") as runner:
            results.append(runner.run(execution(TaskSet.load(TOY_TASKS)["hello"])))

    worker = Threads(run)
    deadline = time.monotonic() + HANG_S
    while not server.requests("main"):  # the first reply has been served: the agent goes to the gate
        assert time.monotonic() < deadline and not worker.errors, worker.errors
        time.sleep(0.05)
    assert not results and len(server.requests("main")) == 1  # no second call can come while the gate is shut
    (gate_dir / "open").touch()
    worker.join()
    (result,) = results
    assert result.reward == 1.0 and len(server.requests("main")) == 2
    assert agent_report(result)["stop_reason"] == "answer"


def test_max_turns_bounds_the_run(server: StandInServer, tmp_path: Path) -> None:
    server.script.main = deque([tool("run", {"command": "echo hi"})])
    server.script.repeat_last = True
    env = {**os.environ, "OPENAI_BASE_URL": f"{server.url}/v1", "OPENAI_API_KEY": TOKEN}
    done = subprocess.run([sys.executable, str(AGENT_DIR / "agent.py"), "say hi", "--workspace", str(tmp_path),
                           "--max-turns", "3", "--compact-every", "0"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["stop_reason"] == "max_turns" and report["turns"] == 3 and report["tool_calls"] == 3
    assert len(server.requests("main")) == 3 and not (tmp_path / "answer.txt").exists()
    assert server.requests("main")[1]["messages"][-1]["content"].startswith("exit code 0\nhi")


@pytest.mark.parametrize("client", ["sdk", "http"])
@pytest.mark.parametrize(("status", "requests", "message"), [
    (503, 3, "model call failed after 3 attempts"),  # retried with backoff, then given up
    (400, 1, "model call refused"),                  # not worth a retry
])
def test_a_model_that_keeps_failing_is_a_harness_error(server: StandInServer, tmp_path: Path, client: str,
                                                       status: int, requests: int, message: str) -> None:
    server.script.main = deque([error(status)])
    server.script.repeat_last = True
    config = HarnessConfig.load(TOY_HARNESS)
    result, sink = run_toy(server, tmp_path, "hello", command=(
        *config.command, "--max-retries", "2", "--retry-backoff-s", "0.01", "--client", client))
    assert result.status == "harness_error" and result.exit_code == 1
    assert message in result.message and str(status) in result.message
    assert len(server.requests("main")) == requests and result.evaluation is None
    [finished] = sink.of(ExecutionFinished)
    assert finished.status == "harness_error"
    assert agent_report(result)["is_error"] is True
