"""Discrete-event simulation of an elastic cluster: drives the real policies and writes a real Gyre log.

Entry points: ``load_scenario`` (TOML in ``replay/scenarios``), ``simulate`` (one policy) and ``compare``
(all three on the same workload). The model and its calibration are described in ``docs/simulator.md``.
"""

from gyre.sim.engine import Simulation, SimulationError
from gyre.sim.runner import COMPARED, SimResult, compare, policy_params, simulate
from gyre.sim.scenario import Scenario, load_scenario, scenario_names
from gyre.sim.workload import ExecutionSpec, Workload, sample_workload

__all__ = [
    "COMPARED", "ExecutionSpec", "Scenario", "SimResult", "Simulation", "SimulationError", "Workload", "compare",
    "load_scenario", "policy_params", "sample_workload", "scenario_names", "simulate",
]
