"""The synthetic generator: realistic structure at any size, deterministic in its seed."""

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from trajectory_helpers import SMALL

from gyre.trajectory import BatchBuilder, CallTree, ExecutionCalls, TrajectoryConfig, TrajectoryConfigError
from gyre.trajectory.source import LogSource
from gyre.trajectory.synth import SynthConfig, generate
from gyre.trajectory.synth_log import SynthSummary, synthesize


def test_small_run_has_the_shape_of_a_long_horizon_run(small_run: tuple[Path, SynthSummary]) -> None:
    _, summary = small_run
    assert summary.executions == 32 and summary.groups == 2
    assert summary.model_calls / summary.executions >= 100  # hundreds of calls per execution
    assert summary.compactions > 0 and summary.sub_agents > 0 and summary.retries > 0
    assert summary.timed_out > 0 and summary.evaluation_failures > 0 and summary.harness_errors > 0
    assert SMALL.min_tokens <= summary.min_execution_tokens
    assert summary.max_execution_tokens <= 1.1 * SMALL.max_tokens


def test_every_synthetic_execution_is_a_valid_tree_with_every_branch_kind(small_run: tuple[Path, SynthSummary]) -> None:
    path, _ = small_run
    source = LogSource(path)
    branches: Counter = Counter()
    mid_segment = 0
    for outcome in source.outcomes()[:6]:
        calls = ExecutionCalls.from_arrow(outcome.execution_id, source.execution_calls(outcome.execution_id))
        tree = CallTree.build(calls)
        branches.update(calls.branch[tree.ends].tolist())
        attached = tree.owner >= 0
        mid_segment += int((tree.attach[attached] < calls.seg_len[tree.owner[attached]] - 1).sum())
        assert (calls.seq[calls.parent[calls.parent >= 0]] < calls.seq[calls.parent >= 0]).all()
    assert set(branches) == {0, 1, 2, 3}  # main, main-summary, sub-agent, sub-agent-summary trajectories
    assert mid_segment > 0  # retries recorded through the failed call


def test_timed_out_runs_are_scored_partially_and_evaluation_failures_carry_no_reward(
    small_run: tuple[Path, SynthSummary],
) -> None:
    path, summary = small_run
    outcomes = LogSource(path).outcomes()
    timed_out = [o for o in outcomes if o.status == "timed_out"]
    assert len(timed_out) == summary.timed_out
    assert all(o.partial and o.reward is not None for o in timed_out if o.eval_error is None)
    failed = [o for o in outcomes if o.verdict == "eval_error"]
    assert len(failed) == summary.evaluation_failures and all(o.reward is None for o in failed)


def test_build_on_the_small_run(small_run: tuple[Path, SynthSummary]) -> None:
    path, summary = small_run
    builder = BatchBuilder(TrajectoryConfig(cap=5))
    batches = list(builder.from_log(path))
    report = builder.report
    assert report.executions == summary.executions
    assert report.excluded_eval_errors == summary.evaluation_failures
    assert report.excluded_harness_errors == summary.harness_errors
    assert report.executions_used + report.excluded_eval_errors + report.excluded_harness_errors == 32
    assert report.trajectories_kept <= 5 * report.executions_used
    assert report.tokens_tree_packed < report.tokens_expanded < report.tokens_expanded_uncapped
    assert sum(b.tokens for b in batches) == report.tokens_tree_packed
    weights = {}
    for batch in batches:
        for row in batch.batch.to_pylist():
            weights[row["execution_id"]] = sum(row["token_weights"])
    assert np.allclose(list(weights.values()), 1.0, rtol=1e-4)


def fingerprint(run: list) -> list:
    return [(c.call_id, c.parent, c.prefix_len, c.delta.tolist(), c.output.tolist()) for e in run for c in e.calls]


def test_same_seed_same_run_other_seed_other_run() -> None:
    config = SynthConfig(executions=3, group_size=3, seed=11, min_tokens=1_000, max_tokens=3_000)
    first, again = generate(config), generate(config)
    other = generate(SynthConfig(executions=3, group_size=3, seed=12, min_tokens=1_000, max_tokens=3_000))
    assert fingerprint(first) == fingerprint(again)
    assert fingerprint(first) != fingerprint(other)


def test_bad_synth_options_are_named(tmp_path: Path) -> None:
    with pytest.raises(TrajectoryConfigError, match="min_tokens"):
        SynthConfig(min_tokens=10, max_tokens=5)
    with pytest.raises(TrajectoryConfigError, match="retry_rate"):
        SynthConfig(retry_rate=2.0)
    config = SynthConfig(executions=1, group_size=1, min_tokens=1_000, max_tokens=1_500)
    synthesize(tmp_path / "log", config)
    with pytest.raises(TrajectoryConfigError, match="already holds a log"):
        synthesize(tmp_path / "log", config)
