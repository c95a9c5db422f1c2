"""The controller: a live run driven as fold → decide → act over its log (see ``controller.py``).

``Controller`` (the loop), the actuator contract (``CellActuator``, ``Rollouts``), the in-process cell
(``LocalCell``), the plan of a run (``RunPlan``).
"""

from gyre.controller.actuator import CellActuator, Rollouts
from gyre.controller.controller import Controller, ControllerError
from gyre.controller.local import LocalCell
from gyre.controller.plan import RunPlan

__all__ = [
    "CellActuator", "Controller", "ControllerError", "LocalCell", "Rollouts", "RunPlan",
]
