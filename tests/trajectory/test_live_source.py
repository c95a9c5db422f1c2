"""Run-scoped, step-filtered, incremental batch sources, and only the last attempt of an execution."""

from pathlib import Path

from gyre.events.models import ExecutionFinished, ExecutionQueued, ModelCallFinished, RewardRecorded
from gyre.log import LogWriter
from gyre.trajectory.source import LiveLogSource, LogSource


def execution(run: str, execution_id: str, group: str, step: int, outputs: list[list[int]], reward: float,
              attempt: int = 0) -> list:
    events: list = [ExecutionQueued(run_id=run, execution_id=execution_id, task_id="t", group_id=group, step=step,
                                    attempt=attempt)]
    for i, output in enumerate(outputs):
        call_id = f"{execution_id}-a{attempt}-c{i}"
        events.append(ModelCallFinished(run_id=run, execution_id=execution_id, call_id=call_id,
                                        cell_id="c0", prompt_delta_ids=[1, 2], output_ids=output,
                                        output_logprobs=[-0.5] * len(output)))
    events += [ExecutionFinished(run_id=run, execution_id=execution_id, status="completed", duration_s=1.0),
               RewardRecorded(run_id=run, execution_id=execution_id, reward=reward)]
    return events


def call_ids(source, groups=None) -> dict[str, list[str]]:
    out = {}
    for group in source.groups(group_ids=groups):
        for member in group.members:
            if member.calls is not None and not isinstance(member.calls, Exception):
                out[member.outcome.execution_id] = [c for c in member.calls.call_ids]
    return out


def test_queries_are_scoped_to_the_run_and_the_step(tmp_path: Path) -> None:
    with LogWriter(tmp_path / "log", run_id="a") as writer:
        writer.append(execution("a", "e1", "g0", 0, [[5, 6]], 1.0) + execution("a", "e2", "g1", 1, [[7]], 0.0)
                      + execution("b", "e1", "g0", 0, [[8, 9, 10]], 0.5))
    scoped = LogSource(tmp_path / "log", run_id="a")
    assert {o.execution_id: o.reward for o in scoped.outcomes()} == {"e1": 1.0, "e2": 0.0}
    assert [o.execution_id for o in scoped.outcomes(group_ids=["g1"])] == ["e2"]
    assert call_ids(scoped, ["g0"]) == {"e1": ["e1-a0-c0"]}


def test_the_live_source_grows_with_the_log_and_agrees_with_a_fresh_one(tmp_path: Path) -> None:
    writer = LogWriter(tmp_path / "log", run_id="a")
    live = LiveLogSource(tmp_path / "log", run_id="a")
    writer.append(execution("a", "e1", "g0", 0, [[5, 6]], 1.0))
    writer.commit()
    assert live.refresh(writer.durable_seq) == 4
    assert call_ids(live, ["g0"]) == {"e1": ["e1-a0-c0"]}
    writer.append(execution("a", "e2", "g1", 1, [[7], [8]], 0.0))
    writer.commit()
    assert live.refresh(writer.durable_seq) == 5 and live.refresh(writer.durable_seq) == 0
    fresh = LogSource(tmp_path / "log", run_id="a")
    assert call_ids(live, ["g1"]) == call_ids(fresh, ["g1"]) == {"e2": ["e2-a0-c0", "e2-a0-c1"]}
    live.close()
    writer.close()


def test_only_the_last_attempt_of_an_execution_is_trained(tmp_path: Path) -> None:
    first = execution("a", "e1", "g0", 0, [[5, 6]], 1.0)[:2]  # queued and one call, then the crash
    with LogWriter(tmp_path / "log", run_id="a") as writer:
        writer.append(first + execution("a", "e1", "g0", 0, [[7]], 0.0, attempt=1))
    source = LogSource(tmp_path / "log", run_id="a")
    [outcome] = source.outcomes()
    assert outcome.calls == 1 and outcome.reward == 0.0
    assert call_ids(source) == {"e1": ["e1-a1-c0"]}
