"""A trainer replica's work loop.

A replica asks the coordinator for a micro-step, runs forward-backward on it (gradients accumulate in its
backend), reports the result, and repeats until nothing is left to claim in the step. The core's replica
calls the ``StepCoordinator`` directly; a satellite's calls travel over the core's gRPC Trainer service
(`gyre.trainer.hub` behind `gyre.cluster.trainer_service`); the loop does not change.
"""

import time
from collections.abc import Callable
from typing import Protocol

from gyre.trainer.batch import TrainBatch
from gyre.trainer.claims import Claim
from gyre.trainer.errors import StepProtocolError
from gyre.trainer.protocol import MicroStepResult, TrainerBackend


class Coordinator(Protocol):
    """What a replica needs from the core."""

    def claim(self, cell_id: str) -> Claim: ...

    def finish(self, cell_id: str, step: int, micro_step: int, result: MicroStepResult) -> None: ...

    def wait_for_work(self, timeout_s: float) -> None: ...


def work(
    backend: TrainerBackend,
    coordinator: Coordinator,
    cell_id: str,
    batch_of: Callable[[int], TrainBatch],
    *,
    timeout_s: float = 600.0,
) -> list[MicroStepResult]:
    """Claim and run micro-steps of the open step until none is left to claim; returns what this replica did."""
    deadline = time.monotonic() + timeout_s
    done: list[MicroStepResult] = []
    while True:
        claim = coordinator.claim(cell_id)
        if claim.status == "done":
            return done
        if claim.status == "wait":
            if time.monotonic() > deadline:
                raise StepProtocolError(f"{cell_id} waited {timeout_s} s for a claimable micro-step")
            coordinator.wait_for_work(0.05)
            continue
        assert claim.step is not None and claim.micro_step is not None
        result = backend.forward_backward(batch_of(claim.micro_step))
        coordinator.finish(cell_id, claim.step, claim.micro_step, result)
        done.append(result)

