"""The runner with trivial shell harnesses: statuses, timeouts that kill the group, the environment, limits."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from gyre.events.models import (
    EvaluationFailed,
    ExecutionFinished,
    ExecutionQueued,
    ExecutionStarted,
    RewardRecorded,
)
from gyre.harness import (
    HARNESS_PLACEHOLDERS,
    HarnessConfig,
    HarnessError,
    HarnessRunner,
    PythonEvaluator,
)
from gyre.log import LogReader, LogWriter
from gyre.sink import LogSink, MemorySink
from tests.harness.harness_helpers import (
    TOKEN,
    execution,
    make_task,
    process_gone,
    raises_key_error,
    shell,
    wait_for,
)

URL = "http://127.0.0.1:9"


def runner(config: HarnessConfig, tmp_path: Path, sink: MemorySink | None = None) -> HarnessRunner:
    return HarnessRunner(config, sink=sink or MemorySink(), proxy_url=URL, root=tmp_path / "executions")


def test_completed_execution_records_events_and_reward(tmp_path: Path) -> None:
    sink = MemorySink()
    task = make_task()
    with runner(shell("printf hello > answer.txt; echo 'a warning' >&2"), tmp_path, sink) as r:
        result = r.run(execution(task, policy_version=3, attempt=0, cell_id="cell0"))
    assert result.status == "completed" and result.exit_code == 0 and result.reward == 1.0
    assert (result.workspace / "answer.txt").read_text() == "hello"
    kinds = [e.kind for e in sink.events]
    assert kinds == ["execution_queued", "execution_started", "execution_finished", "reward_recorded"]
    queued, started, finished, reward = sink.events
    assert isinstance(queued, ExecutionQueued) and queued.task_id == "t" and queued.group_id == "g0"
    assert queued.policy_version == 3 and queued.cell_id == "cell0"
    assert isinstance(started, ExecutionStarted) and started.workspace == str(result.workspace) and started.pid
    assert isinstance(finished, ExecutionFinished) and finished.duration_s > 0 and finished.message == "a warning"
    assert isinstance(reward, RewardRecorded) and reward.partial is False and reward.evaluator == "read-answer"
    assert json.loads(reward.details) == {"text": "hello"}


def test_nonzero_exit_is_harness_error_with_stderr_tail_and_no_reward(tmp_path: Path) -> None:
    sink = MemorySink()
    with runner(shell("echo step one >&2; echo boom: model unreachable >&2; exit 3"), tmp_path, sink) as r:
        result = r.run(execution(make_task()))
    assert result.status == "harness_error" and result.exit_code == 3
    assert result.message == "exit code 3: step one\nboom: model unreachable"
    assert result.evaluation is None and result.reward is None
    assert [e.kind for e in sink.events] == ["execution_queued", "execution_started", "execution_finished"]


def test_harness_errors_can_be_evaluated_when_configured(tmp_path: Path) -> None:
    with runner(shell("printf hi > answer.txt; exit 1", evaluate_harness_errors=True), tmp_path) as r:
        result = r.run(execution(make_task()))
    assert result.status == "harness_error" and result.reward == 0.5


def test_timeout_kills_the_process_group_keeps_the_workspace_and_scores_partially(tmp_path: Path) -> None:
    sink = MemorySink()
    script = "printf hel > answer.txt; sleep 300 & echo $! > child.pid; echo working >&2; wait"
    began = time.monotonic()
    with runner(shell(script, timeout_s=0.5, sandbox="none"), tmp_path, sink) as r:  # host pids: unsandboxed
        result = r.run(execution(make_task()))
    assert time.monotonic() - began < 120  # far below the child's 300 s: the run did not wait for it
    assert result.status == "timed_out"
    assert result.message.startswith("timed out after 0.5s; process group killed: working")
    child = int((result.workspace / "child.pid").read_text())
    wait_for(lambda: process_gone(child), what=f"the harness's child sleep {child} to die")
    assert (result.workspace / "answer.txt").read_text() == "hel"  # the workspace is kept
    reward = sink.of(RewardRecorded)[0]
    assert reward.partial is True and reward.reward == 0.5 and result.reward == 0.5


def test_a_harness_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    script = "trap '' TERM; sleep 300 & echo $! > child.pid; while :; do sleep 0.05; done"
    with runner(shell(script, timeout_s=0.3, kill_grace_s=0.2, sandbox="none"), tmp_path) as r:
        result = r.run(execution(make_task()))
    assert result.status == "timed_out" and result.exit_code == -9
    child = int((result.workspace / "child.pid").read_text())
    wait_for(lambda: process_gone(child), what="the child to die")


def test_leftover_background_processes_are_killed_after_a_normal_exit(tmp_path: Path) -> None:
    with runner(shell("sleep 300 > /dev/null 2>&1 & echo $! > child.pid", sandbox="none"), tmp_path) as r:
        result = r.run(execution(make_task()))
    assert result.status == "completed"
    child = int((result.workspace / "child.pid").read_text())
    wait_for(lambda: process_gone(child), what="the leftover sleep to die")


def test_environment_reaches_the_harness_and_nothing_else_leaks(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_API_KEY", "do-not-leak")
    monkeypatch.setenv("OPENAI_API_KEY", "the-real-key")
    config = shell('env > env.txt; printf "%s\\n" "$@" > argv.txt', model="policy-x",
                   env={"TOOL_TOKEN": "{token}", "WHERE": "{workspace}"})
    config = config.model_copy(update={"command": (*config.command, "sh", "{prompt}", "{task_file}",
                                                   "{answer_file}", "{model}", "{openai_base_url}")})
    with runner(config, tmp_path) as r:
        result = r.run(execution(make_task(), env={"EXTRA": "1"}))
    env = dict(line.split("=", 1) for line in (result.workspace / "env.txt").read_text().splitlines() if "=" in line)
    assert env["OPENAI_BASE_URL"] == f"{URL}/v1" and env["OPENAI_API_KEY"] == TOKEN
    assert env["ANTHROPIC_BASE_URL"] == URL
    assert env["ANTHROPIC_AUTH_TOKEN"] == TOKEN and env["ANTHROPIC_API_KEY"] == TOKEN
    assert env["OPENAI_MODEL"] == env["ANTHROPIC_MODEL"] == "policy-x"
    assert env["HOME"] == str(result.dirs.home) and Path(env["HOME"]).is_dir()
    assert env["PATH"] and env["TOOL_TOKEN"] == TOKEN and env["WHERE"] == str(result.workspace)
    assert env["EXTRA"] == "1" and "SECRET_API_KEY" not in env
    argv = (result.workspace / "argv.txt").read_text().splitlines()
    assert argv == ["Write the word hello into answer.txt.", str(result.dirs.task_file), "answer.txt", "policy-x",
                    f"{URL}/v1"]
    assert result.dirs.task_file.read_text() == "Write the word hello into answer.txt."


def test_unknown_placeholder_fails_when_the_config_is_built() -> None:
    with pytest.raises(ValidationError, match=r"unknown placeholder \{promt\}.*known placeholders: .*\{prompt\}"):
        HarnessConfig(command=["claude", "-p", "{promt}"])
    with pytest.raises(ValidationError, match=r"not a plain name"):
        HarnessConfig(command=["echo", "{prompt!r}"])
    with pytest.raises(ValidationError, match=r"unknown placeholder \{token\}"):
        HarnessConfig(command=["echo", "{token}"])  # the token may go into env only
    assert HarnessConfig(command=["echo", "{{literal}}"]).command == ("echo", "{{literal}}")


def test_a_missing_program_is_a_harness_error_without_a_start(tmp_path: Path) -> None:
    sink = MemorySink()
    with runner(HarnessConfig(command=["/nonexistent/claude", "-p", "{prompt}"]), tmp_path, sink) as r:
        result = r.run(execution(make_task()))
    assert result.status == "harness_error" and result.exit_code is None
    assert "cannot start harness '/nonexistent/claude'" in result.message
    assert [e.kind for e in sink.events] == ["execution_queued", "execution_finished"]


def test_starting_files_and_a_reused_execution_id(tmp_path: Path) -> None:
    files_dir = tmp_path / "start"
    (files_dir / "pkg").mkdir(parents=True)
    (files_dir / "pkg" / "mod.py").write_text("x = 1\n")
    task = make_task(tmp=tmp_path, files_dir="start", files={"notes/a.txt": "A"})
    with runner(shell("cat pkg/mod.py notes/a.txt > answer.txt; ls -a > ls.txt"), tmp_path) as r:
        first = r.run(execution(task))
        again = r.run(execution(task))
        retry = r.run(execution(task, attempt=1))
    assert (first.workspace / "answer.txt").read_text() == "x = 1\nA"
    assert sorted((first.workspace / "ls.txt").read_text().split()) == [".", "..", "answer.txt", "ls.txt",
                                                                        "notes", "pkg"]
    assert again.status == "harness_error" and "exists already" in again.message
    assert retry.status == "completed" and retry.dirs.root.name.endswith(".attempt1")


def test_concurrency_is_bounded_and_groups_keep_their_order(tmp_path: Path) -> None:
    task = make_task()
    config = shell("date +%s.%N > start; sleep 0.3; date +%s.%N > end", max_concurrency=2)
    with runner(config, tmp_path) as r:
        results = r.run_group([execution(task, n) for n in range(4)])
    assert [x.execution_id for x in results] == [f"g0-t-{n}" for n in range(4)]
    spans = [(float((x.workspace / "start").read_text()), float((x.workspace / "end").read_text()))
             for x in results]
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert most == 2


def test_arun_from_asyncio(tmp_path: Path) -> None:
    async def main(r: HarnessRunner) -> list[float | None]:
        results = await asyncio.gather(*(r.arun(execution(make_task(), n)) for n in range(2)))
        return [x.reward for x in results]

    with runner(shell("printf hello > answer.txt"), tmp_path) as r:
        assert asyncio.run(main(r)) == [1.0, 1.0]


def test_close_with_kill_cancels_running_and_queued_executions(tmp_path: Path) -> None:
    sink = MemorySink()
    r = runner(shell("sleep 300", max_concurrency=1), tmp_path, sink)
    running = r.submit(execution(make_task(), 0))
    queued = r.submit(execution(make_task(), 1))
    wait_for(lambda: sink.of(ExecutionStarted), what="the first execution to start")
    assert r.running == 1 and r.queued == 1
    closer = threading.Thread(target=r.close, kwargs={"kill_running": True})
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert running.result().status == "harness_error" and "cancelled" in running.result().message
    assert queued.result().status == "harness_error" and "before it started" in queued.result().message
    assert not sink.of(RewardRecorded) and not sink.of(EvaluationFailed)
    with pytest.raises(HarnessError, match="closed"):
        r.submit(execution(make_task(), 2))


def test_an_evaluator_crash_is_recorded_as_evaluation_failed(tmp_path: Path) -> None:
    sink = MemorySink()
    with runner(shell("true"), tmp_path, sink) as r:
        result = r.run(execution(make_task(evaluator=PythonEvaluator(raises_key_error, name="broken"))))
    assert result.status == "completed" and result.reward is None
    [failed] = sink.of(EvaluationFailed)
    assert failed.error == "crash" and failed.evaluator == "broken" and "KeyError: 'expected'" in failed.message
    assert not sink.of(RewardRecorded)


def test_log_sink_makes_the_events_durable(tmp_path: Path) -> None:
    writer = LogWriter(tmp_path / "log", run_id="run-1")
    sink = LogSink(writer)
    with HarnessRunner(shell("printf hello > answer.txt"), sink=sink, proxy_url=URL,
                       root=tmp_path / "executions") as r:
        r.run(execution(make_task()))
        assert writer.durable_seq == writer.next_seq - 1  # the reward is durable when the run returns
    sink.close()
    events = list(LogReader(tmp_path / "log").events())
    assert [e.kind for e in events] == ["execution_queued", "execution_started", "execution_finished",
                                        "reward_recorded"]
    assert all(e.run_id == "run-1" and e.execution_id == "g0-t-0" for e in events)


def test_every_documented_placeholder_expands(tmp_path: Path) -> None:
    names = sorted(HARNESS_PLACEHOLDERS)
    config = HarnessConfig(command=["/bin/sh", "-c", 'printf "%s\\n" "$@" > values.txt', "sh",
                                    *[f"{{{n}}}" for n in names]], env={"ALL": "{token}:{timeout_s}"})
    with runner(config, tmp_path) as r:
        result = r.run(execution(make_task(), group="grp", policy_version=2))
    values = dict(zip(names, (result.workspace / "values.txt").read_text().splitlines(), strict=True))
    assert values["workspace"] == str(result.workspace) and values["group_id"] == "grp"
    assert values["policy_version"] == "2" and values["timeout_s"] == "600" and values["attempt"] == "0"
    assert values["config_dir"] and values["python"] and values["home"] == str(result.dirs.home)


def test_an_executions_end_is_recorded_inside_its_finishing_hook(tmp_path: Path) -> None:
    """The cluster's proxy orders a cut against executions' ends with this hook: `execution_finished` is recorded
    while the hook is held, and the evaluation that follows is not."""
    import contextlib

    sink = MemorySink()
    inside: list[list[str]] = []

    @contextlib.contextmanager
    def finishing(execution_id: str):
        before = len(sink.events)
        yield
        inside.append([execution_id, *(e.kind for e in sink.events[before:])])

    task = make_task()
    with HarnessRunner(shell("printf hello > answer.txt"), sink=sink, proxy_url=URL, root=tmp_path / "executions",
                       finishing=finishing) as r:
        result = r.run(execution(task))
    assert inside == [[result.execution_id, "execution_finished"]]
    assert [e.kind for e in sink.events][-1] == "reward_recorded"


def test_time_held_by_the_scheduler_does_not_count_toward_the_timeout(tmp_path: Path) -> None:
    """A cut execution (partial rollouts) waits to be placed again; its timeout bounds its time on cells, as
    the simulator's does, so the wait is not counted: held from before it starts, a harness with a 0.5 s
    timeout is still running 2 s on; released, its clock runs again and it times out after its 0.5 s."""
    sink = MemorySink()
    task = make_task()
    with runner(shell("while :; do sleep 0.05; done", timeout_s=0.5, sandbox="none"), tmp_path, sink) as r:
        held = execution(task)
        r.holds.hold(held.execution_id)
        future = r.submit(held)
        wait_for(lambda: any(e.kind == "execution_started" for e in sink.events), what="the harness to start")
        time.sleep(2.0)  # four timeouts' worth of held time: not a race, a lower bound on the held time
        assert not future.done(), "the harness timed out while the scheduler held it"
        r.holds.release(held.execution_id)
        result = future.result(timeout=120)
    assert result.status == "timed_out"
    assert result.duration_s >= 2.0 + 0.5
    assert r.holds.held_s(held.execution_id) == 0.0  # forgotten once it ended
