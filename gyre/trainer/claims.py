"""Which micro-step a replica gets next: a pure decision over the trainer projection.

A step's work is ``planned_micro_steps`` micro-steps. One becomes *claimable* once the data for it exists
(its groups completed and the trajectory processor emitted its micro-batch: ``ready``) and the projection
shows it neither claimed nor finished. Any replica — the core or a satellite — may claim it; the claim
becomes true when its ``micro_step_claimed`` event is appended, which only the core (the log's one
writer) does, so two replicas never get the same micro-step.

Invariants: a claim is never granted twice within a step; ``done`` means nothing is left to claim, not
that everything finished (replicas still working hold the rest); answers depend only on the projection
and ``ready``, so replaying a log reproduces them.
"""

from collections.abc import Container
from dataclasses import dataclass
from typing import Literal

from gyre.state.trainer import StepState, TrainerState

ClaimStatus = Literal["claimed", "wait", "done"]


@dataclass(frozen=True)
class Claim:
    """The answer to a replica asking for work."""

    status: ClaimStatus
    step: int | None = None
    micro_step: int | None = None
    tokens: int = 0


def open_step(state: TrainerState) -> StepState | None:
    """The current step if it is still open (started, not closed)."""
    current = state.current
    return current if current is not None and not current.closed else None


def decide(state: TrainerState, ready: Container[int]) -> Claim:
    """``claimed`` with the lowest claimable micro-step; ``wait`` if some are not ready yet (or no step is
    open); ``done`` if every planned micro-step is claimed or finished."""
    step = open_step(state)
    if step is None:
        return Claim("wait")
    unclaimed = step.unclaimed
    if not unclaimed:
        return Claim("done", step.step)
    for m in unclaimed:
        if m in ready:
            return Claim("claimed", step.step, m)
    return Claim("wait", step.step)


def held_by(state: TrainerState, cell_id: str) -> list[int]:
    """Micro-steps of the open step that ``cell_id`` holds (claimed, finished or not): releasing the cell
    makes exactly these claimable again."""
    step = open_step(state)
    if step is None:
        return []
    return sorted(m for m, cell in step.claimed.items() if cell == cell_id)
