"""Errors of the live cluster's control plane."""

from gyre.errors import GyreError


class ClusterError(GyreError):
    """A control-plane stream or peer failed: refused, unreachable, lost, or a command that cannot complete."""
