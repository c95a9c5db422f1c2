"""Errors of the trajectory processor, inside Gyre's one exception hierarchy."""

from gyre.errors import GyreError


class TrajectoryError(GyreError, ValueError):
    """Recorded model calls do not form a valid trajectory tree; the message names the execution and call.

    The builder counts such an execution as ``excluded_malformed`` (or raises, with ``strict=True``).
    """


class TrajectoryConfigError(TrajectoryError):
    """An option of the trajectory processor is out of range; the message names the option."""
