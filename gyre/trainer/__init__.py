"""The GSPO trainer: loss, backends (torch; Megatron-core), streaming micro-steps and the replica loop.

::

    MicroBatch (gyre.trajectory) -> TrainBatch -> backend.forward_backward  (per claimed micro-step)
                                                -> backend.optimizer_step   (core, once per step)

``loss.py`` is pure (torch only). Backends implement ``TrainerBackend`` (``protocol.py``). The core's
``StepCoordinator`` is the one writer of training events and decides claims on the ``TrainerView``
projection; ``replica.work`` is the loop every replica runs. See ``docs/trainer.md``.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from gyre.trainer.config import GSPOConfig, OptimizerConfig, TorchBackendConfig
from gyre.trainer.errors import (
    BackendUnavailableError,
    BatchFormatError,
    CheckpointError,
    StepProtocolError,
    TrainerConfigError,
    TrainerError,
)

# Everything else loads on first use, so that importing the pure loss does not pull in the log, the
# coordinator or the model code (``tests/trainer/test_trainer_loss.py`` checks).
_LAZY = {
    "TrainBatch": "gyre.trainer.batch",
    "Claim": "gyre.trainer.claims",
    "decide": "gyre.trainer.claims",
    "StepCoordinator": "gyre.trainer.coordinator",
    "StepSummary": "gyre.trainer.coordinator",
    "LossStats": "gyre.trainer.loss",
    "gspo_loss": "gyre.trainer.loss",
    "MicroStepResult": "gyre.trainer.protocol",
    "StepResult": "gyre.trainer.protocol",
    "TrainerBackend": "gyre.trainer.protocol",
    "work": "gyre.trainer.replica",
    "TorchBackend": "gyre.trainer.torch_backend",
}

if TYPE_CHECKING:
    from gyre.trainer.batch import TrainBatch
    from gyre.trainer.claims import Claim, decide
    from gyre.trainer.coordinator import StepCoordinator, StepSummary
    from gyre.trainer.loss import LossStats, gspo_loss
    from gyre.trainer.protocol import MicroStepResult, StepResult, TrainerBackend
    from gyre.trainer.replica import work
    from gyre.trainer.torch_backend import TorchBackend


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gyre.trainer' has no attribute {name!r}")
    return getattr(import_module(module), name)


__all__ = [
    "BackendUnavailableError",
    "BatchFormatError",
    "CheckpointError",
    "Claim",
    "GSPOConfig",
    "LossStats",
    "MicroStepResult",
    "OptimizerConfig",
    "StepCoordinator",
    "StepProtocolError",
    "StepResult",
    "StepSummary",
    "TorchBackend",
    "TorchBackendConfig",
    "TrainBatch",
    "TrainerBackend",
    "TrainerConfigError",
    "TrainerError",
    "decide",
    "gspo_loss",
    "work",
]
