"""The actuator contract: the controller hands over decisions and commands; completions come back as events.

A cell actuator performs a role switch or a train step and records the completion event only when the
action has really completed — `role_switch_completed` with the measured parts of its duration (drain or
redirect, engine pause, weight transfer bytes and seconds, engine resume, trainer join), the trainer's
`train_step_finished` and `weights_published` — on the same sink as every other producer. Calls return at
once: the controller learns of a completion by folding its event, exactly as it will when a cell is a
separate process and this interface is the client side of a gRPC stream (commands down, events up).
A failure is reported to the controller's ``fail`` and ends the run.
"""

from typing import Protocol

from gyre.events.models import RoleSwitchRequested


class CellActuator(Protocol):
    """One cell: its engine, its trainer replica and the gate that admits executions to it."""

    def switch(self, decision: RoleSwitchRequested) -> None:
        """Perform a (recorded, durable) role-switch decision; record its completion when done."""
        ...

    def train(self, step: int, groups: tuple[str, ...]) -> None:
        """Train ``step`` on the batch of ``groups`` (this cell is the core); the trainer records the step."""
        ...

    def close(self) -> None: ...


class Rollouts(Protocol):
    """Where a step's executions are queued: registered with the proxy and handed to the harness runner."""

    def queue(self, step: int, policy_version: int) -> None:
        """Queue step ``step``'s executions; `execution_queued` events are recorded before this returns."""
        ...
