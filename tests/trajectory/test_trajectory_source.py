"""Groups from a real log through DuckDB: outcomes, streaming, and what the report counts."""

import dataclasses
from pathlib import Path

import pytest
from trajectory_helpers import call, rows

from gyre.events import EvaluationFailed, ExecutionFinished, ExecutionQueued, RewardRecorded
from gyre.log import LogWriter
from gyre.trajectory import BatchBuilder, ExecutionOutcome, TrajectoryConfig
from gyre.trajectory import source as source_module
from gyre.trajectory.source import LogSource


def chain(execution: str, base: int) -> list:
    """Two calls and a failed retry: three trajectories' worth of structure in a few tokens."""
    return [
        call("a", delta=[base + 1, base + 2], out=[base + 3], execution=execution),
        call("b", parent="a", prefix=3, delta=[base + 4], out=[base + 5, base + 6], execution=execution),
        call("c", parent="b", prefix=4, out=[base + 7], execution=execution),
    ]


def _unique(events: list) -> list:
    """Call ids are unique per execution in tests; the log needs them unique per run only for show."""
    return [
        e.model_copy(
            update={
                "call_id": f"{e.execution_id}/{e.call_id}",
                "parent_call_id": e.parent_call_id and f"{e.execution_id}/{e.parent_call_id}",
            }
        )
        for e in events
    ]


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "log"
    g1 = ["done", "late", "broken", "rescored", "unscored-again", "crashed"]
    with LogWriter(path, run_id="r") as writer:
        for name in [*g1, "running"]:
            writer.append(ExecutionQueued(execution_id=name, task_id="t", group_id="g2" if name == "running" else "g1"))
        calls_by = {name: _unique(chain(name, 100 * k)) for k, name in enumerate([*g1, "running", "stray"])}
        for step in range(3):  # interleaved, as concurrent executions write them
            writer.append([events[step] for events in calls_by.values()])
        status = {"late": "timed_out", "crashed": "harness_error"}
        for name in g1:
            writer.append(ExecutionFinished(execution_id=name, status=status.get(name, "completed"), duration_s=1.0))
        writer.append(RewardRecorded(execution_id="done", reward=1.0))
        writer.append(RewardRecorded(execution_id="late", reward=0.25, partial=True))
        writer.append(EvaluationFailed(execution_id="broken", error="crash"))
        writer.append(EvaluationFailed(execution_id="rescored", error="infrastructure"))
        writer.append(RewardRecorded(execution_id="rescored", reward=0.5))
        writer.append(RewardRecorded(execution_id="unscored-again", reward=0.0))
        writer.append(EvaluationFailed(execution_id="unscored-again", error="timeout"))
        writer.commit()
    return path


def test_outcomes_follow_the_latest_evaluation(log: Path) -> None:
    verdicts = {o.execution_id: o.verdict for o in LogSource(log).outcomes()}
    assert verdicts == {
        "done": "scored",
        "late": "scored",
        "broken": "eval_error",
        "rescored": "scored",
        "unscored-again": "eval_error",
        "crashed": "harness_error",
        "running": "pending",
        "stray": "unknown_group",
    }
    late = next(o for o in LogSource(log).outcomes() if o.execution_id == "late")
    assert late.partial and late.status == "timed_out" and late.calls == 3


@pytest.mark.parametrize("stream_rows", [1, 2, 4096])
def test_build_from_log_counts_everything(log: Path, stream_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module, "STREAM_ROWS", stream_rows)
    builder = BatchBuilder(TrajectoryConfig(cap=5))
    batch_rows = rows(builder.from_log(log))
    assert sorted(row["execution_id"] for row in batch_rows) == ["done", "late", "rescored"]
    assert {row["execution_id"]: row["reward"] for row in batch_rows} == {"done": 1.0, "late": 0.25, "rescored": 0.5}
    report = builder.report
    assert (report.executions, report.groups, report.groups_used, report.groups_pending) == (8, 2, 1, 1)
    assert (report.excluded_eval_errors, report.excluded_harness_errors) == (2, 1)
    assert (report.excluded_pending, report.excluded_unknown_group) == (1, 1)
    assert report.timed_out_scored == 1
    assert report.trajectories_total == 6 and report.trajectories_kept == 6
    # Per execution: 7 unique tokens; the two trajectories (6 and 5 tokens) share 4.
    assert report.tokens_tree_packed == 3 * 7
    assert report.tokens_expanded == 3 * (6 + 5)
    for row in batch_rows:
        assert sum(row["token_weights"]) == pytest.approx(1.0)


def test_groups_are_handed_on_as_their_last_call_arrives(log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module, "STREAM_ROWS", 1)
    groups = list(LogSource(log).groups())
    # Groups needing no calls come first; g1 once the scan has passed all its members' calls.
    assert [g.group_id for g in groups] == ["g2", None, "g1"]
    loaded = {m.outcome.execution_id for m in groups[-1].members if m.calls is not None}
    assert loaded == {"done", "late", "rescored"}  # evaluation errors' calls are never kept


def test_execution_calls_for_show(log: Path) -> None:
    table = LogSource(log).execution_calls("late")
    assert table.num_rows == 3 and set(table.column("execution_id").to_pylist()) == {"late"}


def test_an_execution_the_scan_returns_short_is_malformed_not_guessed(log: Path) -> None:
    source = LogSource(log)
    real = source.outcomes

    def inflated(group_ids=None) -> list[ExecutionOutcome]:
        return [o if o.execution_id != "done" else dataclasses.replace(o, calls=o.calls + 1)
                for o in real(group_ids)]

    source.outcomes = inflated  # type: ignore[method-assign]
    builder = BatchBuilder(TrajectoryConfig())
    assert sorted(row["execution_id"] for row in rows(builder.batches(source.groups()))) == ["late", "rescored"]
    assert builder.report.excluded_malformed == 1
    assert "returned 3 of its 4 calls" in builder.report.malformed_examples[0]
