"""Errors of the trainer, under the package hierarchy so callers can catch them by meaning."""

from gyre.errors import GyreError


class TrainerError(GyreError):
    """Base class of every error the trainer raises on purpose."""


class TrainerConfigError(TrainerError, ValueError):
    """A trainer, loss or optimizer option is invalid; the message names the field."""


class BatchFormatError(TrainerError, ValueError):
    """A micro-batch violates the batch format (``gyre.trajectory.spec``); the message names the column."""


class BackendUnavailableError(TrainerError, RuntimeError):
    """A backend feature needs hardware or a package this machine lacks (e.g. Megatron's CUDA-only parts)."""


class CheckpointError(TrainerError):
    """A checkpoint is missing, incomplete, or belongs to another model."""


class StepProtocolError(TrainerError):
    """A replica or the coordinator broke the micro-step protocol (unknown step, double finish, ...)."""
