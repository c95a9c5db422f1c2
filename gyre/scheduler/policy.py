"""A policy is a name, a version, a parameter model and two pure functions.

``decide(view, params)`` returns role-switch decisions (events) for the current view; ``initial_roles``
says which role each cell comes up in. ``run_values`` is the version's parameter rule: what a run (live or
a whole simulated one) that leaves parameters unset runs with, where that differs from the model's defaults
(which stay what older logs recorded). Neither reads a clock, does I/O or draws unseeded random numbers:
given the same log prefix they return the same decisions, in the simulator, in replay and live.
Bump ``version`` whenever a change alters decisions; replay refuses to call a mismatch a drift silently.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gyre.errors import ConfigError
from gyre.events.fields import Role
from gyre.events.models import RoleSwitchRequested
from gyre.scheduler.params import PolicyParams
from gyre.scheduler.view import SchedulerView


@dataclass(frozen=True)
class CellSpec:
    """A cell as the policy sees it before it registers."""

    cell_id: str
    is_core: bool
    slots: int


Decide = Callable[[SchedulerView, Any], list[RoleSwitchRequested]]
InitialRoles = Callable[[Sequence[CellSpec], Any], dict[str, Role]]


@dataclass(frozen=True)
class Policy:
    name: str
    version: str
    params_type: type[PolicyParams]
    decide: Decide
    initial_roles: InitialRoles
    run_values: Callable[[dict[str, Any]], dict[str, Any]] = dict

    def run_params(self, values: dict[str, Any] | None = None) -> PolicyParams:
        """The parameters a run given ``values`` runs with: the rule fills in what they leave unset."""
        return self.params(self.run_values(values or {}))

    def params(self, values: dict[str, Any] | str | None = None) -> PolicyParams:
        """Validate parameters (a dict or the JSON stored in ``run_started``) with a clear error."""
        from pydantic import ValidationError

        try:
            if isinstance(values, str):
                return self.params_type.model_validate_json(values or "{}")
            return self.params_type.model_validate(values or {})
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())
            raise ConfigError(f"invalid parameters for policy {self.name!r}: {problems}") from error


def all_rollout(cells: Sequence[CellSpec], params: Any) -> dict[str, Role]:
    return {c.cell_id: "rollout" for c in cells}
