"""`gyre run --emulate SCENARIO`: the run takes the scenario's cluster, batch and accelerator, and faces its
workload — every planned execution's task describes exactly that execution's calls, and the grader gives
the reward the workload drew (or fails the evaluation the workload says fails)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.cluster.config import ClusterConfig
from gyre.cluster.emulated import scenario_overrides
from gyre.harness.tasks import TaskSet
from gyre.run.build import step_plan
from gyre.scheduler import get_policy
from gyre.sim.calls import plan_calls
from gyre.sim.scenario import load_scenario
from gyre.sim.workload import sample_workload

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "cluster-cpu.toml"


def test_an_emulated_run_faces_the_scenarios_workload(tmp_path: Path) -> None:
    run_dir = {"run_dir": str(tmp_path / "run")}
    base = ClusterConfig.load(EXAMPLE, run_dir)
    config = ClusterConfig.load(EXAMPLE, {**scenario_overrides(base, "seed-2.4t-scaled", time_scale=1e4,
                                                               token_scale=100), **run_dir})
    scenario = load_scenario("seed-2.4t-scaled")
    workload = sample_workload(scenario, scenario.seed)
    assert (config.cluster.cells, config.cluster.slots, config.steps) == (8, 4, 12)
    assert (config.rollout.groups_per_step, config.rollout.group_size) == (16, 2)
    assert config.trajectory.micro_steps_per_group == scenario.batch.micro_steps_per_group  # the sim's cut
    assert config.rollout.timeout_s == scenario.rollout.timeout_s / 1e4 and config.sampling.ignore_eos
    emulation = config.emulation()
    assert emulation is not None and (emulation.time_scale, emulation.token_scale) == (1e4, 100)
    assert config.scheduler.params["switch_to_training_s"] == scenario.switch.to_training_s / 1e4
    scenario_elastic = scenario.policy.values("elastic")  # the scenario's parameters, not the file's tuning
    assert base.scheduler.params["hysteresis_slots"] != scenario_elastic["hysteresis_slots"]
    assert config.scheduler.params["hysteresis_slots"] == scenario_elastic["hysteresis_slots"]
    variant = scenario_overrides(base, "seed-2.4t-scaled", time_scale=1e4, token_scale=100,
                                 params={"stream_micro_steps": False})  # an ablation's variant changes one
    assert variant["scheduler.params"]["stream_micro_steps"] is False
    tasks = TaskSet.load(config.rollout.tasks)
    assert len(tasks) == 12 * 16
    by_id = {e.execution_id: e for e in workload.executions()}
    planned = step_plan("run", config.rollout, list(config.rollout.task_ids), 3)
    assert len(planned) == 32
    for execution in planned[:6]:  # step 3, groups 0-2: the scenario's s003-g00G-r0I
        group, rollout = execution.execution_id.rsplit("-g", 1)[1].split("-e")
        spec = by_id[f"s003-g{int(group):03d}-r{int(rollout):02d}"]
        task = tasks[execution.task_id]
        described = json.loads(task.spec.prompt)["executions"][int(rollout)]
        expected = plan_calls(scenario, spec, scenario.seed).to_json(time_scale=1e4, token_scale=100)
        assert described == expected  # the scenario agent makes exactly the workload's calls
        graded = _grade(tmp_path, task.spec.grading, execution.execution_id)
        assert graded == (None if spec.eval_failed else spec.reward)


def test_the_grader_fails_an_evaluation_the_workload_says_fails(tmp_path: Path) -> None:
    grading = {"time_scale": 1e6, "rollouts": [{"reward": 0.25, "eval_s": 1.0, "eval_failed": False},
                                               {"reward": 0.75, "eval_s": 1.0, "eval_failed": True}]}
    assert _grade(tmp_path, grading, "run.s0-g0-e0") == 0.25
    assert _grade(tmp_path, grading, "run.s0-g0-e1") is None  # an evaluator error, never a zero reward


def _grade(tmp_path: Path, grading: dict, execution_id: str) -> float | None:
    grading_file = tmp_path / "grading.json"
    grading_file.write_text(json.dumps({"grading": grading}))
    done = subprocess.run([sys.executable, str(REPO / "agents" / "scenario_agent" / "grade.py"), str(grading_file),
                           execution_id], capture_output=True, text=True, timeout=60)
    if done.returncode == 1:
        return None
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])["reward"]


@pytest.mark.parametrize("policy", ["elastic", "colocate", "async"])
def test_every_policy_gets_parameters_it_takes(tmp_path: Path, policy: str) -> None:
    """Switch costs go only to a policy that plans switches (colocate's parameters refuse them)."""
    base = ClusterConfig.load(EXAMPLE, {"run_dir": str(tmp_path / "run"), "scheduler.policy": policy})
    params = scenario_overrides(base, "seed-2.4t-scaled", time_scale=10, token_scale=100)["scheduler.params"]
    get_policy(policy).params(params)  # raises on a key the policy does not take
    assert ("switch_to_training_s" in params) == (policy == "elastic")


@pytest.mark.parametrize("policy", ["elastic", "colocate", "async"])
def test_every_policy_gets_the_staleness_gyre_sim_gives_it(tmp_path: Path, policy: str) -> None:
    """terminal-bench-like-scaled runs at staleness 1, colocate (synchronous) at 0 in the simulator and live: a
    staleness it refuses stopped the three-design comparison at its colocate run."""
    base = ClusterConfig.load(EXAMPLE, {"run_dir": str(tmp_path / "run"), "scheduler.policy": policy})
    overrides = scenario_overrides(base, "terminal-bench-like-scaled", time_scale=10, token_scale=25)
    assert overrides["scheduler.staleness"] == (0 if policy == "colocate" else 1)
    get_policy(policy).params({**overrides["scheduler.params"], "staleness": overrides["scheduler.staleness"]})
