"""A streamed train step on the core: it opens on its first complete group, trains that group's micro-steps
while the next is still rolling out (order proven by the log's seqs), and ends with the same loss and weights
as the same step trained on its whole batch (same micro-steps in the same order, same normaliser)."""

import threading
import time
from pathlib import Path

import pytest
import torch

from gyre.config import TrainConfig
from gyre.events.models import ExecutionFinished, ExecutionQueued, ModelCallFinished, RewardRecorded
from gyre.log import LogReader, LogWriter
from gyre.model import build_tiny_model
from gyre.sink import LogSink
from gyre.trainer import StepCoordinator, TorchBackend, TorchBackendConfig
from gyre.trainer.core import LocalCoreTrainer
from gyre.trainer.errors import TrainerError
from gyre.trainer.weights import WeightStore

RUN = "r"
GROUPS = {"g0": [1.0, 0.0], "g1": [0.0, 1.0]}


def rollout(group: str) -> list:
    """The group's executions queued and called (no reward yet)."""
    events: list = []
    for i in range(len(GROUPS[group])):
        execution_id = f"{group}-e{i}"
        events += [ExecutionQueued(run_id=RUN, execution_id=execution_id, task_id="t", group_id=group, step=0),
                   ModelCallFinished(run_id=RUN, execution_id=execution_id, call_id=f"{execution_id}-c0",
                                     cell_id="c0", prompt_delta_ids=[1, 2, 3], output_ids=[4 + i, 5, 6 + i],
                                     output_logprobs=[-0.5, -0.4, -0.3]),
                   ExecutionFinished(run_id=RUN, execution_id=execution_id, status="completed", duration_s=1.0)]
    return events


def rewards(group: str) -> list:
    return [RewardRecorded(run_id=RUN, execution_id=f"{group}-e{i}", reward=r) for i, r in enumerate(GROUPS[group])]


def core(tmp_path: Path, writer: LogWriter, per_group: int | None = 2) -> LocalCoreTrainer:
    config = TrainConfig.model_validate({"trajectory": {"micro_steps_per_group": per_group}, "trainer": {"lr": 1e-2}})
    torch.manual_seed(0)
    backend = TorchBackend(build_tiny_model(0), TorchBackendConfig(dtype="float64"))
    sink = LogSink(writer, close_writer=False)
    return LocalCoreTrainer(config, cell_id="c0", run_id=RUN, log_path=writer.path, backend=backend,
                            coordinator=StepCoordinator(sink), weights=WeightStore(tmp_path), published=None,
                            durable_seq=lambda: writer.durable_seq)


def seqs(path: Path) -> dict[tuple, int]:
    out = {}
    for event in LogReader(path).events():
        if event.kind == "micro_step_finished":
            out["finished", event.micro_step] = event.seq
        elif event.kind == "reward_recorded":
            out["reward", event.execution_id] = event.seq
        elif event.kind in ("train_step_started", "train_step_finished"):
            out[event.kind,] = event.seq
    return out


def test_a_streamed_step_trains_its_first_group_before_the_last_completes_and_equals_the_whole_batch(tmp_path):
    with LogWriter(tmp_path / "streamed" / "log", run_id=RUN) as writer:
        writer.append(rollout("g0") + rewards("g0") + rollout("g1"))  # g1 still waits on its evaluation
        writer.commit()
        streamed = core(tmp_path / "streamed", writer)
        failure: list[BaseException] = []

        def train() -> None:
            try:
                streamed.train_step(0, ("g0", "g1"))
            except BaseException as error:
                failure.append(error)

        thread = threading.Thread(target=train)
        thread.start()
        coordinator = streamed.coordinator
        while not failure and not (0 in coordinator.state.steps and coordinator.state.steps[0].finished >= {0, 1}):
            coordinator.wait_for_work(0.05)  # woken by each micro-step finishing: no timing race
        assert not failure, failure
        assert coordinator.state.steps[0].planned_micro_steps == 4 and not coordinator.state.steps[0].closed
        writer.append(rewards("g1"))
        writer.commit()
        thread.join(120)
        assert not thread.is_alive() and not failure, failure
        streamed.close()
    at = seqs(writer.path)
    assert at["reward", "g0-e1"] < at["train_step_started",] < at["reward", "g1-e0"]
    assert max(at["finished", 0], at["finished", 1]) < at["reward", "g1-e0"] < at["finished", 2]
    assert at["train_step_finished",] > at["finished", 3]

    with LogWriter(tmp_path / "whole" / "log", run_id=RUN) as writer:
        writer.append(rollout("g0") + rewards("g0") + rollout("g1") + rewards("g1"))
        writer.commit()
        whole = core(tmp_path / "whole", writer)
        whole.train_step(0, ("g0", "g1"))
        whole.close()
    finished = {}
    for name in ("streamed", "whole"):
        (event,) = [e for e in LogReader(tmp_path / name / "log").events() if e.kind == "train_step_finished"]
        finished[name] = (event.micro_steps, event.samples, event.loss, event.tokens)
    assert finished["streamed"] == finished["whole"] and finished["whole"][:2] == (4, 4)
    for (name, a), (_, b) in zip(streamed.backend.named_tensors(), whole.backend.named_tensors(), strict=True):
        assert torch.equal(a, b), name


def test_a_step_cannot_stream_without_a_fixed_cut(tmp_path):
    with LogWriter(tmp_path / "log", run_id=RUN) as writer:
        writer.append(rollout("g0") + rewards("g0") + rollout("g1"))
        writer.commit()
        trainer = core(tmp_path, writer, per_group=None)
        with pytest.raises(TrainerError, match="micro_steps_per_group"):
            trainer.train_step(0, ("g0", "g1"))
        trainer.close()


def test_a_prepared_core_loads_the_log_before_its_first_step_and_trains_it_the_same(tmp_path):
    """`prepare` follows the log from the start, so a first step reads only what came since; the batch is
    the one an unprepared core builds (nothing loaded twice, nothing missed across the hand-over)."""
    results = {}
    for name in ("prepared", "cold"):
        with LogWriter(tmp_path / name / "log", run_id=RUN) as writer:
            writer.append(rollout("g0") + rewards("g0"))
            writer.commit()
            trainer = core(tmp_path / name, writer)
            if name == "prepared":
                trainer.prepare(poll_s=0.01)
                deadline = time.monotonic() + 120  # waits for a state, not for a duration
                while (trainer._source is None or trainer._source.next_seq <= writer.durable_seq) \
                        and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert trainer._source is not None and trainer._source.next_seq > writer.durable_seq
            writer.append(rollout("g1") + rewards("g1"))
            writer.commit()
            trainer.train_step(0, ("g0", "g1"))
            trainer.close()
        (event,) = [e for e in LogReader(tmp_path / name / "log").events() if e.kind == "train_step_finished"]
        results[name] = (event.micro_steps, event.samples, event.loss, event.tokens)
    assert results["prepared"] == results["cold"] and results["cold"][:2] == (4, 4)
