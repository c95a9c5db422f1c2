"""Errors of the live cluster's control plane."""

from gyre.errors import GyreError


class ClusterError(GyreError):
    """A control-plane stream or peer failed: refused, unreachable, lost, or a command that cannot complete."""


class PeerLost(ClusterError):
    """A command failed because its process was declared lost: the controller's membership handling (restart,
    re-registration, resubmitted rollouts) takes over, so the action that sent it is not a run failure."""


class Unavailable(ClusterError):
    """A peer a command needs is not ready yet or restarting (a core restoring its trainer): the command may
    succeed when sent again (`gyre.cluster.failures`)."""
