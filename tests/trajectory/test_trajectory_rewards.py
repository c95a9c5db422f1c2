"""Which executions count: evaluation errors out (never reward 0), time-outs in, groups and advantages."""

import numpy as np
import pyarrow as pa
import pytest
from trajectory_helpers import call, calls, group, outcome, rows

from gyre.trajectory import BatchBuilder, Group, Member, TrajectoryConfig, TrajectoryError, advantages, build


def simple(execution: str, out: tuple[int, ...] = (7, 8)):
    return calls(call("a", delta=[1, 2], out=list(out), execution=execution))


def test_advantage_is_group_normalised() -> None:
    adv = advantages(np.array([1.0, 0.0, 0.5, 0.5]), eps=1e-6)
    assert adv.tolist() == pytest.approx([1.4142, -1.4142, 0.0, 0.0], abs=1e-3)
    assert advantages(np.array([0.3, 0.3]), eps=1e-6).tolist() == [0.0, 0.0]


def test_evaluation_errors_are_excluded_never_scored_zero() -> None:
    g = group(
        [
            (outcome("ok1", reward=1.0), simple("ok1")),
            (outcome("ok2", reward=0.0), simple("ok2")),
            (outcome("broken", reward=None, error="crash"), simple("broken")),
        ]
    )
    batches, report = build([g])
    assert {row["execution_id"] for row in rows(batches)} == {"ok1", "ok2"}
    assert report.excluded_eval_errors == 1 and report.executions_used == 2
    # Excluded, not zero: the advantages are those of a group of two, not of three.
    adv = {row["execution_id"]: row["advantages"][0] for row in rows(batches)}
    assert adv == pytest.approx({"ok1": 1.0, "ok2": -1.0}, abs=1e-5)


def test_timed_out_execution_scored_on_its_workspace_counts() -> None:
    g = group(
        [
            (outcome("done", reward=0.9), simple("done")),
            (outcome("late", reward=0.4, status="timed_out", partial=True), simple("late")),
        ]
    )
    batches, report = build([g])
    assert {row["execution_id"] for row in rows(batches)} == {"done", "late"}
    assert report.timed_out_scored == 1


def test_harness_errors_unscored_are_excluded() -> None:
    g = group(
        [
            (outcome("a", reward=1.0), simple("a")),
            (outcome("b", reward=0.0), simple("b")),
            (outcome("c", reward=None, status="harness_error"), simple("c")),
        ]
    )
    _, report = build([g])
    assert report.excluded_harness_errors == 1 and report.executions_used == 2


def test_group_with_too_few_valid_executions_is_dropped_and_counted() -> None:
    g = group([(outcome("a", reward=1.0), simple("a")), (outcome("b", reward=None, error="timeout"), simple("b"))])
    batches, report = build([g], TrajectoryConfig(min_valid_per_group=2))
    assert batches == []
    assert report.groups_dropped == 1 and report.excluded_in_dropped_groups == 1
    assert report.excluded_eval_errors == 1


def test_pending_group_waits() -> None:
    g = group([(outcome("a", reward=1.0), simple("a")), (outcome("b", reward=None, status="completed"), None)])
    batches, report = build([g])
    assert batches == [] and report.groups_pending == 1 and report.excluded_pending == 2


def test_executions_never_queued_are_counted() -> None:
    g = Group(None, (Member(outcome("stray", group=None)),))
    _, report = build([g])
    assert report.excluded_unknown_group == 1 and report.groups == 0


def test_zero_variance_group_is_kept_with_zero_advantages() -> None:
    g = group([(outcome("a", reward=0.0), simple("a")), (outcome("b", reward=0.0), simple("b"))])
    batches, report = build([g])
    assert report.groups_zero_variance == 1
    assert all(a == 0.0 for row in rows(batches) for a in row["advantages"])


def test_malformed_execution_is_excluded_and_named_or_raised_when_strict() -> None:
    dangling = _events_table(
        [call("x", out=[1], execution="bad"), call("y", parent="nope", prefix=1, out=[2], execution="bad")]
    )
    g = Group(
        "g1",
        (
            Member(outcome("a", reward=1.0), simple("a")),
            Member(outcome("b", reward=0.0), simple("b")),
            Member(outcome("bad", reward=1.0), dangling),
        ),
    )
    lenient = BatchBuilder(TrajectoryConfig())
    assert {row["execution_id"] for row in rows(lenient.batches([g]))} == {"a", "b"}
    assert lenient.report.excluded_malformed == 1
    assert "names parent 'nope'" in lenient.report.malformed_examples[0]
    strict = BatchBuilder(TrajectoryConfig(strict=True))
    with pytest.raises(TrajectoryError, match="names parent 'nope'"):
        list(strict.batches([g]))


def test_scored_execution_without_calls_is_excluded() -> None:
    g = group(
        [
            (outcome("a", reward=1.0), simple("a")),
            (outcome("b", reward=0.0), simple("b")),
            (outcome("empty", reward=1.0, n_calls=0), None),
        ]
    )
    _, report = build([g])
    assert report.excluded_no_calls == 1 and report.executions_used == 2


def test_execution_without_policy_tokens_is_excluded() -> None:
    g = group(
        [
            (outcome("a", reward=1.0), simple("a")),
            (outcome("b", reward=0.0), simple("b")),
            (outcome("silent", reward=0.5), simple("silent", out=())),
        ]
    )
    _, report = build([g])
    assert report.excluded_no_policy_tokens == 1 and report.executions_used == 2


def _events_table(events: list) -> pa.Table:
    return pa.table(
        {
            "call_id": [e.call_id for e in events],
            "parent_call_id": [e.parent_call_id for e in events],
            "branch": [e.branch for e in events],
            "prefix_len": [e.prefix_len for e in events],
            "prompt_delta_ids": pa.array([e.prompt_delta_ids for e in events], pa.list_(pa.int32())),
            "output_ids": pa.array([e.output_ids for e in events], pa.list_(pa.int32())),
            "output_logprobs": pa.array([e.output_logprobs for e in events], pa.list_(pa.float32())),
            "policy_version": [0] * len(events),
            "seq": list(range(len(events))),
        }
    )


def test_step_metrics_summarise_rewards_advantages_and_response_lengths() -> None:
    """The batch statistics a train step logs: over used executions only, group spread per group."""
    first = group([(outcome("a", reward=1.0, group="g1"), simple("a", (7, 8, 9))),
                   (outcome("b", reward=0.0, group="g1"), simple("b")),
                   (outcome("x", reward=None, error="crash", group="g1"), simple("x"))], "g1")
    second = group([(outcome("c", reward=0.5, group="g2"), simple("c")),
                    (outcome("d", reward=0.5, group="g2"), simple("d", (5,)))], "g2")
    _, report = build([first, second])
    metrics = report.step_metrics()
    assert metrics["reward_mean"] == pytest.approx(0.5)
    assert metrics["reward_std"] == pytest.approx(np.std([1.0, 0.0, 0.5, 0.5]))
    assert metrics["group_reward_std"] == pytest.approx((0.5 + 0.0) / 2)
    assert metrics["groups_zero_variance"] == 1
    assert metrics["advantage_mean"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["advantage_min"] == pytest.approx(-1.0, abs=1e-5)
    assert metrics["advantage_max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["response_tokens_mean"] == pytest.approx((3 + 2 + 2 + 1) / 4)
    assert metrics["response_tokens_max"] == 3
    summary = report.to_dict()["rewards"]
    assert summary["count"] == 4 and summary["mean"] == pytest.approx(0.5)


def test_step_metrics_of_an_empty_build_are_missing_not_zero() -> None:
    _, report = build([])
    metrics = report.step_metrics()
    assert metrics["reward_mean"] is None and metrics["advantage_std"] is None
    assert metrics["response_tokens_max"] is None
