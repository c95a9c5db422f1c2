"""The one narrow interface every trainer backend implements (torch on CPU/GPU, Megatron on GPU).

Nothing above a backend imports torch.distributed, megatron or a model class: the streaming trainer drives
any backend through these calls, and ``tests/trainer/test_trainer_backend_conformance.py`` runs the same checks on
each of them.
"""

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from gyre.trainer.batch import TrainBatch
from gyre.trainer.loss import LossStats

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class MicroStepResult:
    """What one forward-backward contributed: loss sums (to add across micro-steps and replicas) and cost."""

    index: int
    tokens: int
    """Tokens forwarded: run through the model (packed: shared prefixes once, across executions too)."""
    padded_tokens: int
    passes: int
    stats: LossStats
    duration_s: float
    trained_tokens: int = 0
    """Tokens whose log-prob enters the loss (policy tokens, each trained once)."""

    @property
    def loss(self) -> float:
        return self.stats.loss


@dataclass(frozen=True)
class StepResult:
    """An applied optimizer step."""

    policy_version: int
    """Version of the weights after the step."""
    grad_norm: float
    """Global norm of the normalised gradient, before clipping."""
    normalizer: float
    """Total token weight the summed gradient was divided by."""


@runtime_checkable
class TrainerBackend(Protocol):
    """Load weights, forward-backward a micro-batch (accumulating gradients), step, export named tensors.

    Tensor names are Hugging Face names (``model.layers.0.self_attn.q_proj.weight``) whatever the backend's
    own layout, so an engine, a checkpoint or another backend can take them as they are.
    """

    policy_version: int

    def load_weights(self, tensors: NamedTensors, *, policy_version: int | None = None) -> None:
        """Replace every parameter (all must be given); optionally set the version the weights carry."""
        ...

    def forward_backward(self, batch: TrainBatch, *, loss_scale: float = 1.0) -> MicroStepResult:
        """Run the micro-batch and add ``loss_scale * d(loss_sum)/d(theta)`` to the accumulated gradients."""
        ...

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The accumulated gradients, in a fixed order, as tensors a collective may reduce in place."""
        ...

    def zero_grad(self) -> None: ...

    def optimizer_step(self, normalizer: float) -> StepResult:
        """Divide the accumulated gradients by ``normalizer``, clip, step, zero them, bump the version."""
        ...

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter once (tied weights under their first name), detached, in HF names."""
        ...

    def save_checkpoint(self, directory: str | Path) -> Path: ...

    def load_checkpoint(self, directory: str | Path) -> None: ...
