"""Streaming micro-steps: claims decided on the trainer projection, events for every fact, the log's fold
equal to the coordinator's state, and replicas that never get the same micro-step."""

import threading

import pytest

from gyre.log import LogReader, LogWriter
from gyre.sink import LogSink
from gyre.state import TrainerState, TrainerView, fold, replay
from gyre.trainer import Claim, StepCoordinator, StepProtocolError, decide
from gyre.trainer.loss import LossStats
from gyre.trainer.protocol import MicroStepResult, StepResult
from gyre.trainer.replica import work


def result(index: int, loss_sum: float = 1.0) -> MicroStepResult:
    return MicroStepResult(index=index, tokens=10, padded_tokens=12, passes=1,
                           stats=LossStats(loss_sum=loss_sum, weight=2.0, tokens=4, units=1), duration_s=0.01,
                           trained_tokens=4)


def started(planned: int) -> TrainerState:
    from gyre.events.models import TrainStepStarted

    return fold(TrainerView(), [TrainStepStarted(step=0, policy_version=0, planned_micro_steps=planned)])


def test_decide_is_pure_over_the_projection_and_readiness():
    assert decide(TrainerState(), {0}) == Claim("wait")  # no open step
    state = started(3)
    assert decide(state, set()) == Claim("wait", 0)  # nothing ready yet: groups still running
    assert decide(state, {2, 1}) == Claim("claimed", 0, 1)
    state.steps[0].claimed[1] = "core"
    assert decide(state, {2, 1}) == Claim("claimed", 0, 2)
    state.steps[0].claimed[2] = "satellite-1"
    assert decide(state, {1, 2}) == Claim("wait", 0)  # 0 is planned but not ready
    state.steps[0].finished.add(0)
    assert decide(state, {1, 2}) == Claim("done", 0)  # everything claimed or finished


@pytest.fixture
def writer(tmp_path):
    with LogWriter(tmp_path / "log") as w:
        yield w


@pytest.fixture
def sink(writer):
    sink = LogSink(writer, close_writer=False)
    yield sink
    sink.close()


def test_a_step_is_a_sequence_of_events_and_the_log_folds_to_the_same_state(writer, sink):
    c = StepCoordinator(sink)
    step = c.start_step(2, groups=1)
    assert c.claim("core") == Claim("wait", step)
    c.mark_ready({0: 10}, {0: ("e1", "e2")})
    first = c.claim("core")
    assert first == Claim("claimed", 0, 0, 10)
    assert c.claim("satellite-1").status == "wait"
    c.mark_ready({1: 7}, {1: ("e3",)})
    second = c.claim("satellite-1")
    assert (second.micro_step, second.tokens) == (1, 7)
    assert c.claim("core") == Claim("done", 0)
    c.finish("core", 0, 0, result(0, 1.0))
    assert not c.all_finished()
    c.finish("satellite-1", 0, 1, result(1, 3.0))
    assert c.all_finished()
    summary = c.close_step(StepResult(policy_version=1, grad_norm=0.5, normalizer=2.0))
    assert (summary.samples, summary.tokens, summary.trained_tokens, summary.stats.loss_sum) == (3, 20, 8, 4.0)
    c.publish(1, tensors=3, nbytes=100, location="memory")
    events = list(LogReader(writer.path).events())
    assert [e.kind for e in events] == [
        "train_step_started", "micro_step_claimed", "micro_step_claimed", "micro_step_finished",
        "micro_step_finished", "train_step_finished", "weights_published",
    ]
    finished = events[-2]
    assert (finished.policy_version, finished.micro_steps, finished.samples, finished.loss) == (1, 2, 3, 2.0)
    assert (finished.tokens, finished.tokens_trained) == (20, 8)  # forwarded and trained tokens of the step
    assert [(e.tokens, e.tokens_trained) for e in events[3:5]] == [(10, 4), (10, 4)]
    replayed, _ = replay(TrainerView(), writer.path)
    assert replayed == c.state
    assert replayed.policy_version == 1 and replayed.published_version == 1
    assert replayed.steps[0].claimed == {0: "core", 1: "satellite-1"}


def test_a_restarted_coordinator_resumes_from_the_log(tmp_path):
    with LogSink(LogWriter(tmp_path / "log")) as sink:
        c = StepCoordinator(sink)
        c.start_step(1)
        c.mark_ready({0: 5})
        c.claim("core")
        c.finish("core", 0, 0, result(0))
        c.close_step(StepResult(policy_version=1, grad_norm=0.1, normalizer=1.0))
    with LogSink(LogWriter(tmp_path / "log")) as sink:
        again = StepCoordinator.resume(sink, tmp_path / "log")
        assert again.state.policy_version == 1
        assert again.start_step(1) == 1
        assert again.state.steps[1].policy_version == 1


def test_protocol_violations_are_refused(sink):
    c = StepCoordinator(sink)
    with pytest.raises(StepProtocolError, match="no open step"):
        c.mark_ready({0: 1})
    c.start_step(2)
    with pytest.raises(StepProtocolError, match="still open"):
        c.start_step(1)
    with pytest.raises(StepProtocolError, match="outside"):
        c.mark_ready({5: 1})
    c.mark_ready({0: 1, 1: 1})
    c.claim("core")
    with pytest.raises(StepProtocolError, match="owned by core"):
        c.finish("satellite-1", 0, 0, result(0))
    c.finish("core", 0, 0, result(0))
    with pytest.raises(StepProtocolError, match="twice"):
        c.finish("core", 0, 0, result(0))
    with pytest.raises(StepProtocolError, match="before every planned micro-step"):
        c.close_step(StepResult(policy_version=1, grad_norm=0.0, normalizer=1.0))


def test_concurrent_replicas_never_share_a_micro_step(writer, sink):
    c = StepCoordinator(sink)
    c.start_step(40)
    c.mark_ready({m: 1 for m in range(40)})
    got: dict[str, list[int]] = {f"cell-{i}": [] for i in range(4)}

    def replica(cell: str) -> None:
        while (claim := c.claim(cell)).status == "claimed":
            got[cell].append(claim.micro_step)
            c.finish(cell, claim.step, claim.micro_step, result(claim.micro_step))

    threads = [threading.Thread(target=replica, args=(cell,)) for cell in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(m for ms in got.values() for m in ms) == list(range(40))
    assert c.all_finished()
    state, _ = replay(TrainerView(), writer.path)
    assert {m: cell for cell, ms in got.items() for m in ms} == state.steps[0].claimed


def test_the_work_loop_runs_what_it_claims(sink):
    class Backend:
        def forward_backward(self, batch):
            return result(batch)

    c = StepCoordinator(sink)
    c.start_step(3)
    feeder = threading.Timer(0.1, lambda: c.mark_ready({0: 1, 1: 1, 2: 1}))  # data arrives after the claims start
    feeder.start()
    done = work(Backend(), c, "core", lambda m: m, timeout_s=10)  # type: ignore[arg-type]
    feeder.join()
    assert [r.index for r in done] == [0, 1, 2]

