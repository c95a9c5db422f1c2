"""Scheduling policies: pure ``decide(view, params) -> decisions`` functions shared by live, sim and replay.

Nothing here imports a server, a clock or a random generator; see ``policy.py`` for the contract.
"""

from gyre.errors import ConfigError
from gyre.scheduler.colocate import COLOCATE
from gyre.scheduler.decisions import InsufficientCapacityError
from gyre.scheduler.elastic import ELASTIC, ELASTIC_V1, ELASTIC_V2, ELASTIC_V3
from gyre.scheduler.fixed_pools import ASYNC
from gyre.scheduler.params import (
    ELASTIC3_MECHANISMS,
    ELASTIC3_PARTIAL_MECHANISMS,
    AsyncParams,
    ColocateParams,
    ElasticParams,
    PolicyParams,
)
from gyre.scheduler.policy import CellSpec, Policy
from gyre.scheduler.view import SchedulerFold, SchedulerView, WorkState, WorkView

POLICIES: dict[str, Policy] = {p.name: p for p in (ELASTIC, COLOCATE, ASYNC)}
"""The current version of each policy, by name."""
VERSIONS: dict[str, Policy] = {p.version: p for p in (ELASTIC_V1, ELASTIC_V2, ELASTIC_V3, COLOCATE, ASYNC)}
"""Every version still shipped, so a recorded run replays under the policy that made it."""
DECISION_KINDS = frozenset({"role_switch_requested"})
"""Event kinds a policy emits; everything else in a log is the world reacting."""


def get_policy(name: str, version: str | None = None) -> Policy:
    """The current version of policy ``name``, or the given ``version`` of it when that is still shipped."""
    try:
        current = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}") from None
    if version is None or version == current.version:
        return current
    chosen = VERSIONS.get(version)
    if chosen is None or chosen.name != name:
        known = ", ".join(v for v, p in VERSIONS.items() if p.name == name)
        raise ConfigError(f"unknown version {version!r} of policy {name!r}; shipped versions: {known}")
    return chosen


__all__ = [
    "ASYNC",
    "COLOCATE",
    "DECISION_KINDS",
    "ELASTIC",
    "ELASTIC3_MECHANISMS",
    "ELASTIC3_PARTIAL_MECHANISMS",
    "ELASTIC_V1",
    "ELASTIC_V2",
    "ELASTIC_V3",
    "POLICIES",
    "VERSIONS",
    "AsyncParams",
    "CellSpec",
    "ColocateParams",
    "ElasticParams",
    "InsufficientCapacityError",
    "Policy",
    "PolicyParams",
    "SchedulerFold",
    "SchedulerView",
    "WorkState",
    "WorkView",
    "get_policy",
]
