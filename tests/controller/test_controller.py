"""The controller over real logs with stand-in actuators: explicit decision points replay exactly.

The stand-ins do what a cell and the harness runner do, as events: a role switch completes, a train step
runs and publishes, executions are queued, start, finish and are scored on another thread — so decisions
land while other producers append, and replay must still rebuild each view at exactly its prefix.
"""

import threading

import pytest

from gyre.controller import Controller, RunPlan
from gyre.events.models import (
    CellRegistered,
    CommandAbandoned,
    ExecutionFinished,
    ExecutionQueued,
    ExecutionStarted,
    RewardRecorded,
    RoleSwitchCompleted,
    RoleSwitchRequested,
    RunStarted,
    TrainStepFinished,
    TrainStepStarted,
    WeightsPublished,
)
from gyre.harness.runner import Gate
from gyre.log import LogReader, LogWriter
from gyre.replay.exact import replay_decisions
from gyre.scheduler import get_policy
from gyre.sink import LogSink


class StandInCell:
    def __init__(self, sink: LogSink, gate: Gate) -> None:
        self.producer = sink.producer("cell:c0")
        self.gate = gate
        self.version = 0

    def switch(self, decision: RoleSwitchRequested) -> None:
        if decision.to_role == "training":
            self.gate.close()
            self.gate.wait_idle()
        else:
            self.gate.open()
        self.producer.record(RoleSwitchCompleted(cell_id=decision.cell_id, from_role=decision.from_role,
                                                 to_role=decision.to_role, duration_s=0.01))

    def train(self, step: int, groups: tuple[str, ...]) -> None:
        self.producer.record([
            TrainStepStarted(step=step, policy_version=self.version, planned_micro_steps=1, groups=len(groups)),
            TrainStepFinished(step=step, policy_version=self.version + 1, micro_steps=1),
            WeightsPublished(policy_version=self.version + 1),
        ])
        self.version += 1

    def close(self) -> None:
        pass


class StandInRollouts:
    """Queues on the controller's thread; the executions run on a thread of their own."""

    def __init__(self, sink: LogSink, size: int, gate: Gate) -> None:
        self.producer = sink.producer("harness")
        self.size = size
        self.gate = gate
        self.threads: list[threading.Thread] = []

    def queue(self, step: int, policy_version: int) -> None:
        ids = [f"r.s{step}-e{i}" for i in range(self.size)]
        self.producer.record([ExecutionQueued(execution_id=e, task_id="t", group_id=f"r.s{step}-g{i % 2}",
                                              policy_version=policy_version, step=step)
                              for i, e in enumerate(ids)])

        def run() -> None:
            for e in ids:
                assert self.gate.enter(lambda: False)  # only while the cell serves rollouts
                self.producer.record(ExecutionStarted(execution_id=e, cell_id="c0"))
                self.producer.record(ExecutionFinished(execution_id=e, status="completed", duration_s=1.0))
                self.producer.record(RewardRecorded(execution_id=e, reward=0.5))
                self.gate.leave()

        thread = threading.Thread(target=run)
        self.threads.append(thread)
        thread.start()


class AbandoningCell(StandInCell):
    """Its first switch to training is given up on (its join kept failing): the cell stays in rollout."""

    abandoned = False

    def switch(self, decision: RoleSwitchRequested) -> None:
        if decision.to_role == "training" and not self.abandoned:
            self.abandoned = True
            self.producer.record(CommandAbandoned(cell_id=decision.cell_id, command="join_step", attempts=3,
                                                  reason="the core's trainer is not ready yet",
                                                  switch_to="training"))
            return
        super().switch(decision)


def drive(log_dir, policy_name: str, steps: int = 3, cell: type[StandInCell] = StandInCell) -> Controller:
    policy = get_policy(policy_name)
    params = policy.params({})
    sink = LogSink(LogWriter(log_dir, run_id="r"))
    gate = Gate()
    rollouts = StandInRollouts(sink, size=4, gate=gate)
    controller = Controller(sink, policy, params, RunPlan(steps=steps), cells={}, rollouts=rollouts)
    controller.cells["c0"] = cell(sink, gate)
    controller.record([RunStarted(run_id="r", name="t", policy=policy.name, policy_version=policy.version,
                                  policy_params=params.model_dump_json(), decision_points="explicit"),
                       CellRegistered(cell_id="c0", role="rollout", is_core=True, slots=2)])
    try:
        controller.run(tick_s=5.0)
    finally:
        for t in rollouts.threads:
            t.join()
        sink.close()
    return controller


@pytest.mark.parametrize("policy", ["elastic", "colocate"])
def test_a_live_log_replays_with_no_mismatch(tmp_path, policy):
    controller = drive(tmp_path / "log", policy)
    report = replay_decisions(tmp_path / "log")
    assert report.mismatches == [], report.to_dict()
    assert report.decisions == controller.stats.decisions > 0
    decisions = list(LogReader(tmp_path / "log").events(kinds=["role_switch_requested"]))
    assert all(d.decided_at_seq is not None and d.decided_at_seq < d.seq for d in decisions)
    # one cell: it trains when a step's data is ready and serves otherwise, so the roles alternate
    assert [d.to_role for d in decisions] == ["training", "rollout"] * 2 + ["training"]


def test_an_abandoned_switch_is_decided_again_and_replays_exactly(tmp_path):
    controller = drive(tmp_path / "log", "elastic", steps=2, cell=AbandoningCell)
    report = replay_decisions(tmp_path / "log")
    assert report.mismatches == [], report.to_dict()
    decisions = list(LogReader(tmp_path / "log").events(kinds=["role_switch_requested"]))
    assert [d.to_role for d in decisions] == ["training", "training", "rollout", "training"]
    [abandoned] = LogReader(tmp_path / "log").events(kinds=["command_abandoned"])
    assert decisions[0].seq < abandoned.seq < decisions[1].decided_at_seq + 1  # decided again on seeing it
    assert all(c.switching_to is None for c in controller.view.cluster.cells.values())


def test_replay_reports_an_altered_decision(tmp_path):
    drive(tmp_path / "log", "elastic", steps=2)
    events = list(LogReader(tmp_path / "log").events())
    target = next(i for i, e in enumerate(events) if isinstance(e, RoleSwitchRequested) and e.to_role == "rollout")
    tampered = list(events)
    tampered[target] = events[target].model_copy(update={"reason": "tampered", "watermark": 99})
    with LogWriter(tmp_path / "tampered", run_id="r") as writer:
        writer.append([e.model_copy(update={"seq": None}) for e in tampered])
    report = replay_decisions(tmp_path / "tampered")
    assert len(report.mismatches) == 1
    [mismatch] = report.mismatches
    assert mismatch.seq == events[target].seq
    assert mismatch.recorded[0]["reason"] == "tampered" and mismatch.replayed[0]["reason"] != "tampered"


def test_replay_reports_a_decision_moved_to_another_prefix(tmp_path):
    drive(tmp_path / "log", "elastic", steps=2)
    events = list(LogReader(tmp_path / "log").events())
    target = next(i for i, e in enumerate(events) if isinstance(e, RoleSwitchRequested))
    moved = events[target].model_copy(update={"decided_at_seq": events[target].decided_at_seq - 3})
    with LogWriter(tmp_path / "moved", run_id="r") as writer:
        writer.append([e.model_copy(update={"seq": None}) for e in [*events[:target], moved, *events[target + 1:]]])
    assert replay_decisions(tmp_path / "moved").mismatches


def test_a_batch_recorded_as_arrow_folds_and_is_observed_as_its_events(tmp_path) -> None:
    """Columnar ingest: a remote producer's Arrow batch gives the view the same fold as its events, and an
    observer of some kinds sees exactly those events, with their seqs."""
    from datetime import UTC, datetime, timedelta

    from gyre.events.models import ModelCallFinished, ModelCallStarted
    from gyre.events.wire import pack_events, unpack_batches

    policy = get_policy("elastic")
    stream = [ExecutionQueued(execution_id="e0", task_id="t", group_id="g", step=0),
              ExecutionStarted(execution_id="e0", cell_id="c0"),
              ModelCallStarted(execution_id="e0", call_id="k0", cell_id="c0", prompt_tokens=5),
              ModelCallFinished(execution_id="e0", call_id="k0", cell_id="c0", output_ids=[1, 2],
                                output_logprobs=[-0.5, -0.25]),
              ModelCallStarted(execution_id="e0", call_id="k1", cell_id="c0", prompt_tokens=9),
              ExecutionFinished(execution_id="e0", status="completed", duration_s=1.0),
              RewardRecorded(execution_id="e0", reward=1.0)]
    start = datetime(2026, 1, 1, tzinfo=UTC)
    stream = [e.model_copy(update={"producer": "proxy", "producer_seq": i, "ts": start + timedelta(seconds=i)})
              for i, e in enumerate(stream)]
    views, observed = [], []
    for columnar in (False, True):
        with LogSink(LogWriter(tmp_path / f"log{columnar}", run_id="r")) as sink:
            controller = Controller(sink, policy, policy.params({}), RunPlan(steps=1), cells={}, rollouts=None)
            seen: list[tuple[int, str]] = []
            controller.observe(lambda seq, e, seen=seen: seen.append((seq, e.kind)),
                               kinds=("execution_finished", "model_call_finished"))
            controller.record(CellRegistered(cell_id="c0", role="rollout", is_core=True, slots=2, ts=start))
            if columnar:
                (batch,) = unpack_batches(pack_events(stream))
                sink.record_batch(batch)
            else:
                sink.record(stream)
            controller.fold_now()
            views.append(repr(controller.view))
            observed.append(seen)
    assert views[0] == views[1]
    assert observed[0] == observed[1] == [(4, "model_call_finished"), (6, "execution_finished")]
    assert "group_origin={'g': (0, 0)}" in views[1]  # the batch was folded at all


def test_consecutive_arrow_batches_fold_as_one_and_the_rest_stays_in_order() -> None:
    from datetime import UTC, datetime

    from gyre.controller.controller import _Batch, _coalesced
    from gyre.events import encode

    ts = datetime(2026, 1, 1, tzinfo=UTC)
    cell = [RoleSwitchCompleted(cell_id="c0", from_role="rollout", to_role="training", duration_s=0.1, ts=ts)]
    queued = [ExecutionQueued(execution_id="e", task_id="t", group_id="g", step=0, ts=ts)]
    a = _Batch(encode(cell, 0).drop_columns(["seq"]), [(0, cell[0])])
    b = _Batch(encode(queued, 1).drop_columns(["seq"]), [])
    merged = _coalesced([(0, a), (1, b), (2, queued), (3, a), (5, b)])  # 5: not after 3, never merged with it
    assert [(first, type(x).__name__) for first, x in merged] == [(0, "_Batch"), (2, "list"), (3, "_Batch"),
                                                                 (5, "_Batch")]
    assert merged[0][1].batch.column("kind").to_pylist() == ["role_switch_completed", "execution_queued"]
    assert merged[0][1].observed == [(0, cell[0])]


def test_an_observer_with_a_columns_form_gets_the_batch_and_nothing_is_decoded_for_it(tmp_path) -> None:
    """`LiveRun` folded at record time from a batch's columns equals its fold of the same events one by one,
    and no row becomes an event object when every observer of the batch takes its columns."""
    from datetime import UTC, datetime, timedelta

    from gyre.controller import controller as controller_module
    from gyre.events.models import ModelCallFinished, ModelCallStarted
    from gyre.events.wire import pack_events, unpack_batches
    from gyre.run.live import LiveRun

    policy = get_policy("elastic")
    start = datetime(2026, 1, 1, tzinfo=UTC)
    stream = [ExecutionQueued(execution_id="e0", task_id="t", group_id="g", step=0, policy_version=0),
              ExecutionStarted(execution_id="e0", cell_id="c0"),
              ModelCallStarted(execution_id="e0", call_id="k0", cell_id="c0", prompt_tokens=5),
              ModelCallFinished(execution_id="e0", call_id="k0", cell_id="c0", output_ids=[1, 2],
                                output_logprobs=[-0.5, -0.25]),
              ExecutionFinished(execution_id="e0", status="completed", duration_s=1.0),
              RewardRecorded(execution_id="e0", reward=1.0)]
    stream = [e.model_copy(update={"producer": "proxy", "producer_seq": i, "ts": start + timedelta(seconds=i)})
              for i, e in enumerate(stream)]
    states, calls = [], []
    decoded: list[frozenset[str] | None] = []
    real_decode = controller_module.decode_kinds

    def counting_decode(batch, kinds):
        decoded.append(kinds)
        return real_decode(batch, kinds)

    for columnar in (False, True):
        live = LiveRun()
        seen: list[tuple[str, int]] = []
        with LogSink(LogWriter(tmp_path / f"log{columnar}", run_id="r")) as sink:
            controller = Controller(sink, policy, policy.params({}), RunPlan(steps=1), cells={}, rollouts=None)
            controller.observe(live.apply, at_record=True, kinds=live.kinds, columns=live.apply_columns)
            controller.observe(lambda seq, e, seen=seen: seen.append(("event", seq)), kinds=live.kinds,
                               columns=lambda first, columns, seen=seen: seen.append(("columns", first)))
            controller.record(CellRegistered(cell_id="c0", role="rollout", is_core=True, slots=2, ts=start))
            if columnar:
                (batch,) = unpack_batches(pack_events(stream))
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(controller_module, "decode_kinds", counting_decode)
                    sink.record_batch(batch)
            else:
                sink.record(stream)
            controller.fold_now()
        states.append((repr(live.cells), repr(live.run)))
        calls.append(seen)
    assert states[0] == states[1]
    assert "'e0'" in states[1][1]  # the batch reached the run view at all
    assert calls[0] == [("event", 0), ("event", 1), ("event", 5), ("event", 6)]  # the kinds it names
    assert calls[1] == [("event", 0), ("columns", 1)]  # the batch once, from the seq of its first row
    assert decoded == []
