"""Scheduling policies: pure ``decide(view, params) -> decisions`` functions shared by live, sim and replay.

Nothing here imports a server, a clock or a random generator; see ``policy.py`` for the contract.
"""

from gyre.errors import ConfigError
from gyre.scheduler.colocate import COLOCATE
from gyre.scheduler.decisions import InsufficientCapacityError
from gyre.scheduler.elastic import ELASTIC
from gyre.scheduler.fixed_pools import ASYNC
from gyre.scheduler.params import AsyncParams, ColocateParams, ElasticParams, PolicyParams
from gyre.scheduler.policy import CellSpec, Policy
from gyre.scheduler.view import SchedulerFold, SchedulerView, WorkState, WorkView

POLICIES: dict[str, Policy] = {p.name: p for p in (ELASTIC, COLOCATE, ASYNC)}
DECISION_KINDS = frozenset({"role_switch_requested"})
"""Event kinds a policy emits; everything else in a log is the world reacting."""


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}") from None


__all__ = [
    "ASYNC", "COLOCATE", "DECISION_KINDS", "ELASTIC", "POLICIES", "AsyncParams", "CellSpec", "ColocateParams",
    "ElasticParams", "InsufficientCapacityError", "Policy", "PolicyParams", "SchedulerFold", "SchedulerView",
    "WorkState", "WorkView", "get_policy",
]
