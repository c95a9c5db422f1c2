"""Projections: the batch driver equals the per-event fold, and snapshot + rest equals a full replay."""

from pathlib import Path
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.events import decode, encode
from gyre.events.models import (
    CallRedirected,
    CellLost,
    CellRegistered,
    EvaluationFailed,
    ExecutionFinished,
    ExecutionQueued,
    ExecutionStarted,
    MicroStepClaimed,
    MicroStepFinished,
    ModelCallFinished,
    ModelCallStarted,
    RewardRecorded,
    RoleSwitchCompleted,
    RoleSwitchRequested,
    RunStarted,
    SatelliteJoined,
    SatelliteLeft,
    TrainStepFinished,
    TrainStepStarted,
    WeightsLoaded,
    WeightsPublished,
)
from gyre.log import LogWriter
from gyre.state import (
    PROJECTIONS,
    BatchColumns,
    ClusterView,
    ExecutionsView,
    RunView,
    TrainerView,
    fold,
    fold_batches,
    load_snapshot,
    replay,
    restore,
    save_snapshot,
    take_snapshot,
)
from gyre.state.cluster import CellsView

cells = st.sampled_from(["c0", "c1", "c2"])
executions = st.sampled_from([f"e{i}" for i in range(6)])
calls = st.sampled_from([f"k{i}" for i in range(8)])
roles = st.sampled_from(["rollout", "training", "idle"])

any_event = st.one_of(
    st.builds(CellRegistered, cell_id=cells, role=roles, slots=st.integers(0, 8), is_core=st.booleans()),
    st.builds(CellLost, cell_id=cells),
    st.builds(RoleSwitchRequested, cell_id=cells, from_role=roles, to_role=roles),
    st.builds(RoleSwitchCompleted, cell_id=cells, from_role=roles, to_role=roles, duration_s=st.floats(0, 10)),
    st.builds(ExecutionQueued, execution_id=executions, task_id=st.just("t"), group_id=st.sampled_from(["g0", "g1"])),
    st.builds(ExecutionStarted, execution_id=executions, cell_id=st.none() | cells),
    st.builds(ExecutionFinished, execution_id=executions, duration_s=st.floats(0, 100),
              status=st.sampled_from(["completed", "timed_out", "harness_error"])),
    st.builds(ModelCallStarted, execution_id=executions, call_id=calls, cell_id=cells),
    st.builds(lambda e, k, c, n: ModelCallFinished(execution_id=e, call_id=k, cell_id=c, output_ids=[1] * n,
                                                   output_logprobs=[-0.5] * n),
              executions, calls, cells, st.integers(0, 5)),
    st.builds(CallRedirected, execution_id=executions, call_id=calls, from_cell_id=cells, to_cell_id=cells),
    st.builds(RewardRecorded, execution_id=executions, reward=st.floats(0, 1), partial=st.booleans()),
    st.builds(EvaluationFailed, execution_id=executions, error=st.sampled_from(["crash", "timeout"])),
    st.builds(TrainStepStarted, step=st.integers(0, 3), policy_version=st.integers(0, 3),
              planned_micro_steps=st.integers(0, 4)),
    st.builds(MicroStepClaimed, step=st.integers(0, 3), cell_id=cells, micro_step=st.integers(0, 4)),
    st.builds(MicroStepFinished, step=st.integers(0, 3), cell_id=cells, micro_step=st.integers(0, 4)),
    st.builds(TrainStepFinished, step=st.integers(0, 3), policy_version=st.integers(0, 4),
              micro_steps=st.integers(0, 4), samples=st.integers(0, 16)),
    st.builds(WeightsPublished, policy_version=st.integers(0, 4)),
    st.builds(SatelliteJoined, cell_id=cells, step=st.integers(0, 3), policy_version=st.integers(0, 3)),
    st.builds(SatelliteLeft, cell_id=cells),
)


def logged(events: list) -> list:
    """The events as the log returns them (with seq and ts)."""
    return list(decode(encode(events, 0, [1_000_000 + i for i in range(len(events))])))


@given(st.lists(any_event, max_size=60), st.integers(1, 7))
@settings(max_examples=80, deadline=None)
def test_batch_driver_equals_the_per_event_fold(events: list, chunk: int) -> None:
    events = logged(events) if events else []
    for projection_type in (*PROJECTIONS.values(), CellsView):  # CellsView: `LiveRun` folds batches' columns
        projection = projection_type()
        by_event = fold(projection, events)
        batches = [encode(events[i:i + chunk], i, [1_000_000 + j for j in range(i, min(i + chunk, len(events)))])
                   for i in range(0, len(events), chunk)]
        by_batch = fold_batches(projection, batches)
        by_columns = projection.initial()
        for batch in batches:
            projection.apply_columns(by_columns, BatchColumns(batch))
        assert by_columns == by_event
        assert by_batch == by_event  # by meaning: a dict's or a set's order may differ (the cluster view
        # skips calls done within a batch, so their entries are never created and then removed)


few_calls = st.sampled_from(["k0", "k1", "k2"])
few_executions = st.sampled_from(["e0", "e1"])
call_event = st.one_of(
    st.builds(ModelCallStarted, execution_id=few_executions, call_id=few_calls, cell_id=cells),
    st.builds(lambda e, k: ModelCallFinished(execution_id=e, call_id=k, cell_id="c0", output_ids=[1],
                                             output_logprobs=[-0.5]), few_executions, few_calls),
    st.builds(CallRedirected, execution_id=few_executions, call_id=few_calls, from_cell_id=cells, to_cell_id=cells),
    st.builds(ExecutionFinished, execution_id=few_executions, duration_s=st.just(1.0), status=st.just("completed")),
)


@given(st.lists(call_event, max_size=80), st.integers(1, 12))
@settings(max_examples=500, deadline=None)
def test_cluster_view_skipping_calls_done_within_a_batch_changes_nothing(events: list, chunk: int) -> None:
    """Call-heavy streams in big batches: repeated ids, finishes before starts, mismatched executions."""
    events = logged(events) if events else []
    projection = ClusterView()
    batches = [encode(events[i:i + chunk], i, [1_000_000 + j for j in range(i, min(i + chunk, len(events)))])
               for i in range(0, len(events), chunk)]
    with patch("gyre.state.cluster.SKIP_PAIRS_FROM_ROWS", 0):  # the skip, on batches of any size
        assert fold_batches(projection, batches) == fold(projection, events)


def test_cluster_view_does_not_skip_a_call_an_execution_still_lists() -> None:
    """``k`` finished under another execution stays listed under e1; a later start + finish under e1
    removes it there, so that pair must be folded (a skip left e1 listing it, and e1 finishing later then
    dropped ``k`` while it was in flight under e2)."""
    events = logged([ModelCallStarted(execution_id="e1", call_id="k", cell_id="c0"),
                     ModelCallFinished(execution_id="e2", call_id="k", cell_id="c0"),
                     ModelCallStarted(execution_id="e1", call_id="k", cell_id="c0"),
                     ModelCallFinished(execution_id="e1", call_id="k", cell_id="c0"),
                     ModelCallStarted(execution_id="e2", call_id="k", cell_id="c0"),
                     ExecutionFinished(execution_id="e1", status="completed", duration_s=1.0)])
    projection = ClusterView()
    with patch("gyre.state.cluster.SKIP_PAIRS_FROM_ROWS", 0):
        by_batch = fold_batches(projection, [encode(events[i:i + 2], i) for i in range(0, len(events), 2)])
    assert by_batch == fold(projection, events)
    assert by_batch.inflight("c0") == ["k"]


def test_cluster_view_skips_the_rows_of_a_call_done_within_the_batch() -> None:
    from gyre.state.cluster import ClusterState, _calls_not_done_within

    events = logged([ModelCallStarted(execution_id="e", call_id="done", cell_id="c"),
                     ModelCallStarted(execution_id="e", call_id="open", cell_id="c"),
                     ModelCallFinished(execution_id="e", call_id="done", cell_id="c"),
                     ModelCallStarted(execution_id="e", call_id="twice", cell_id="c"),
                     ModelCallFinished(execution_id="e", call_id="twice", cell_id="c")])
    batch = encode(events, 0)
    assert _calls_not_done_within(batch, ClusterState()).to_pylist() == [False, True, False, False, False]
    # "twice" was in flight before this batch: its start here overwrites that, so both rows are folded.
    in_flight = ClusterState(call_cell={"twice": "c"}, execution_calls={"e": {"twice"}})
    assert _calls_not_done_within(batch, in_flight).to_pylist() == [False, True, False, True, True]


@given(st.lists(any_event, max_size=60), st.floats(0, 1))
@settings(max_examples=80, deadline=None)
def test_snapshot_plus_rest_equals_full_replay(events: list, where: float) -> None:
    events = logged(events) if events else []
    cut = int(where * len(events))
    for projection_type in PROJECTIONS.values():
        projection = projection_type()
        full = fold(projection, events)
        snapshot = take_snapshot(projection, fold(projection, events[:cut]), seq=cut - 1)
        resumed = fold(projection, events[cut:], restore(projection, snapshot))
        assert resumed == full  # by meaning: a set restored from a snapshot may iterate in another order


def test_replay_from_a_log_with_a_snapshot_file(tmp_path: Path) -> None:
    log = tmp_path / "log"
    first = [CellRegistered(cell_id="c0", role="rollout", slots=4),
             ExecutionQueued(execution_id="e0", task_id="t", group_id="g"),
             ExecutionQueued(execution_id="e1", task_id="t", group_id="g")]
    later = [ExecutionStarted(execution_id="e0", cell_id="c0"),
             ModelCallStarted(execution_id="e0", call_id="k", cell_id="c0"),
             RoleSwitchRequested(cell_id="c0", from_role="rollout", to_role="training")]
    with LogWriter(log) as writer:
        writer.append(first)
    view = ClusterView()
    state, seq = replay(view, log)
    assert seq == 2 and state.watermark == 2
    save_snapshot(take_snapshot(view, state, seq), tmp_path / "cluster.json")
    with LogWriter(log) as writer:
        writer.append(later)
    resumed, seq = replay(view, log, snapshot=load_snapshot(tmp_path / "cluster.json"))
    full, _ = replay(view, log)
    assert seq == 5 and resumed == full
    assert resumed.inflight("c0") == ["k"]
    assert resumed.rollout_capacity == 0  # c0 is leaving rollout
    with pytest.raises(ValueError, match="cannot restore"):
        restore(TrainerView(), load_snapshot(tmp_path / "cluster.json"))


def test_cluster_view_tracks_watermark_calls_and_roles() -> None:
    view = ClusterView()
    state = fold(view, logged([
        CellRegistered(cell_id="a", role="rollout", slots=2, is_core=True),
        CellRegistered(cell_id="b", role="rollout", slots=3),
        *[ExecutionQueued(execution_id=f"e{i}", task_id="t", group_id="g") for i in range(4)],
        ExecutionStarted(execution_id="e0", cell_id="b"),
        ModelCallStarted(execution_id="e0", call_id="k0", cell_id="b"),
        ModelCallStarted(execution_id="e0", call_id="k1", cell_id="b"),
        CallRedirected(execution_id="e0", call_id="k1", from_cell_id="b", to_cell_id="a"),
        RoleSwitchRequested(cell_id="b", from_role="rollout", to_role="training"),
        ExecutionFinished(execution_id="e1", status="completed", duration_s=1),
    ]))
    assert state.watermark == 3  # e0 running, e2 and e3 queued; e1 finished without starting
    assert state.inflight("b") == ["k0"] and state.inflight("a") == ["k1"]
    assert state.rollout_capacity == 2
    state = fold(view, logged([RoleSwitchCompleted(cell_id="b", from_role="rollout", to_role="training",
                                                   duration_s=8.5),
                               ExecutionFinished(execution_id="e0", status="timed_out", duration_s=9)]), state)
    assert state.cells["b"].role == "training" and state.watermark == 2
    assert state.inflight("a") == [] and state.inflight("b") == []  # its harness is gone


def test_executions_view_never_turns_an_evaluator_error_into_a_reward() -> None:
    state = fold(ExecutionsView(), logged([
        ExecutionQueued(execution_id="a", task_id="t", group_id="g"),
        ExecutionQueued(execution_id="b", task_id="t", group_id="g"),
        ExecutionFinished(execution_id="a", status="timed_out", duration_s=5),
        RewardRecorded(execution_id="a", reward=0.4, partial=True),
        ExecutionFinished(execution_id="b", status="completed", duration_s=5),
        EvaluationFailed(execution_id="b", error="crash"),
    ]))
    a, b = state.executions["a"], state.executions["b"]
    assert a.scored and a.reward == 0.4 and a.reward_partial and a.status == "timed_out"
    assert not b.scored and b.reward is None and b.evaluation_error == "crash"
    assert state.by_status() == {"timed_out": 1, "completed": 1}


def test_trainer_view_follows_a_step() -> None:
    state = fold(TrainerView(), logged([
        TrainStepStarted(step=0, policy_version=0, planned_micro_steps=3),
        MicroStepClaimed(step=0, cell_id="core", micro_step=0),
        MicroStepClaimed(step=0, cell_id="sat", micro_step=1),
        SatelliteJoined(cell_id="sat", step=0, policy_version=0),
        MicroStepFinished(step=0, cell_id="core", micro_step=0),
    ]))
    assert state.current.unclaimed == [2] and state.current.pending == [1, 2]
    assert state.satellites == {"sat"}
    state = fold(TrainerView(), logged([
        MicroStepFinished(step=0, cell_id="sat", micro_step=1),
        MicroStepFinished(step=0, cell_id="core", micro_step=2),
        TrainStepFinished(step=0, policy_version=1, micro_steps=3, samples=16, tokens=1000, loss=0.1),
        WeightsPublished(policy_version=1),
    ]), state)
    assert state.current.closed and state.policy_version == 1 and state.published_version == 1
    assert state.consumed_samples == 16


def test_run_view_folds_step_records_held_out_outcomes_and_weights() -> None:
    state = fold(RunView(), logged([
        RunStarted(run_id="r", name="r", policy="elastic", policy_version="elastic/2", config="{}", seed=0),
        ExecutionQueued(execution_id="a", task_id="t", group_id="g", step=0, policy_version=0),
        ExecutionQueued(execution_id="b", task_id="t", group_id="g", step=0, policy_version=0),
        ExecutionQueued(execution_id="h1", task_id="t", group_id="heldout-s0-t"),
        ExecutionQueued(execution_id="h2", task_id="t", group_id="heldout-s0-t"),
        ExecutionQueued(execution_id="h3", task_id="t", group_id="heldout-s0-t"),
        ExecutionFinished(execution_id="a", status="completed", duration_s=1),
        RewardRecorded(execution_id="a", reward=1.0),
        ExecutionFinished(execution_id="b", status="completed", duration_s=1),
        EvaluationFailed(execution_id="b", error="crash"),  # excluded: never a reward of 0
        ExecutionFinished(execution_id="h1", status="completed", duration_s=1),
        RewardRecorded(execution_id="h1", reward=0.5),
        ExecutionFinished(execution_id="h2", status="harness_error", duration_s=1),
        ExecutionFinished(execution_id="h3", status="completed", duration_s=1),
        EvaluationFailed(execution_id="h3", error="crash"),
        TrainStepFinished(step=0, policy_version=1, micro_steps=2, tokens=40, tokens_trained=30, loss=0.1,
                          duration_s=2.5),
        WeightsPublished(policy_version=1, location="weights/v000001.safetensors", sha256="ab"),
        WeightsLoaded(cell_id="cell1", policy_version=1, cause="publish"),
        CellLost(cell_id="cell2", reason="x"),
    ]))
    step = state.steps[0]
    assert step.executions == ["a", "b"] and step.rewards == {"a": 1.0} and step.reward_mean == 1.0
    assert step.trained and (step.micro_steps, step.forwarded_tokens, step.trained_tokens) == (2, 40, 30)
    assert step.train_s == 2.5 and step.rollout_s == pytest.approx(7e-6)  # a queued to b finished: 7 us
    assert state.outcomes == {"h1": 0.5, "h2": None, "h3": None}
    assert state.latest is not None and state.latest.version == 1 and state.engine_versions == {"cell1": 1}
    assert state.run_id == "r" and state.finished is None
