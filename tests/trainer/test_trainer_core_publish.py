"""On an emulated accelerator the core's publish is the engines' pull, not the core's time: the core trains its
next step while the push lasts, `weights_published` (then the checkpoint of the right step) is recorded when
the push is over, and the next step's optimizer waits for it — so versions and checkpoints stay in order.
The order is forced with an event on the publish's hold, never with a timer."""

import threading
from pathlib import Path

import torch

from gyre.config import TrainConfig
from gyre.emulate.clock import Accelerator, Emulation, Pacer
from gyre.emulate.trainer import PacedBackend
from gyre.events.models import ExecutionFinished, ExecutionQueued, ModelCallFinished, RewardRecorded
from gyre.log import LogReader, LogWriter
from gyre.model import build_tiny_model
from gyre.sink import LogSink
from gyre.trainer import StepCoordinator, TorchBackend, TorchBackendConfig
from gyre.trainer.core import LocalCoreTrainer
from gyre.trainer.weights import WeightStore

RUN = "r"
ACCEL = Accelerator(step_ms=30, per_request_ms=1.6, per_mtoken_ms=16.64, prefill_s_per_mtoken=30,
                    train_s_per_mtoken=1, optimizer_s=0, publish_s=1e6, satellite_join_s=0, to_training_s=0,
                    to_rollout_s=0, kv_bytes_per_token=100_000, kv_gb_per_s=50)


def batch(step: int) -> list:
    """Two scored groups of two executions for ``step``."""
    events: list = []
    for g in range(2):
        for i in range(2):
            execution_id = f"s{step}-g{g}-e{i}"
            events += [ExecutionQueued(run_id=RUN, execution_id=execution_id, task_id="t", group_id=f"s{step}-g{g}",
                                       step=step),
                       ModelCallFinished(run_id=RUN, execution_id=execution_id, call_id=f"{execution_id}-c0",
                                         cell_id="c0", prompt_delta_ids=[1, 2, 3], output_ids=[4 + i, 5, 6 + g],
                                         output_logprobs=[-0.5, -0.4, -0.3]),
                       ExecutionFinished(run_id=RUN, execution_id=execution_id, status="completed", duration_s=1.0),
                       RewardRecorded(run_id=RUN, execution_id=execution_id, reward=float(i))]
    return events


def test_an_emulated_publish_overlaps_the_next_step_and_is_recorded_before_its_optimizer(tmp_path: Path) -> None:
    pushing, push_over = threading.Event(), threading.Event()

    def sleep(seconds: float) -> None:  # only the publish's hold waits; every other hold is instant
        if threading.current_thread().name.startswith("gyre-publish"):
            pushing.set()
            assert push_over.wait(120), "the test never ended the push"

    pacer = Pacer(Emulation(accelerator=ACCEL), sleep=sleep)
    config = TrainConfig.model_validate({"trajectory": {"micro_steps_per_group": 1}, "trainer": {"lr": 1e-2}})
    torch.manual_seed(0)
    with LogWriter(tmp_path / "log", run_id=RUN) as writer:
        writer.append(batch(0) + batch(1))
        writer.commit()
        backend = PacedBackend(TorchBackend(build_tiny_model(0), TorchBackendConfig(dtype="float64")), pacer)
        core = LocalCoreTrainer(config, cell_id="c0", run_id=RUN, log_path=writer.path, backend=backend,
                                coordinator=StepCoordinator(LogSink(writer, close_writer=False)),
                                weights=WeightStore(tmp_path), published=None,
                                durable_seq=lambda: writer.durable_seq, pacer=pacer)
        core.train_step(0, ("s0-g0", "s0-g1"))  # returns with its push under way
        assert pushing.wait(120) and core.published() is not None and core.published().version == 1
        assert not [e for e in LogReader(writer.path).events() if e.kind == "weights_published"]

        second = threading.Thread(target=core.train_step, args=(1, ("s1-g0", "s1-g1")))
        second.start()
        coordinator = core.coordinator
        while not (1 in coordinator.state.steps and len(coordinator.state.steps[1].finished) == 2):
            coordinator.wait_for_work(0.05)  # step 1's micro-steps train while version 1 is being pushed
        assert not coordinator.state.steps[1].closed  # its optimizer waits for the push
        push_over.set()
        second.join(120)
        assert not second.is_alive()
        core.close()
    events = list(LogReader(tmp_path / "log").events())
    at = {(e.kind, getattr(e, "step", None), getattr(e, "policy_version", None)): e.seq for e in events
          if e.kind in ("train_step_started", "train_step_finished", "weights_published", "checkpoint_saved")}
    assert (at["train_step_finished", 0, 1] < at["train_step_started", 1, 1] < at["weights_published", None, 1]
            < at["checkpoint_saved", 0, 1] < at["train_step_finished", 1, 2] < at["weights_published", None, 2]
            < at["checkpoint_saved", 1, 2])
