"""The work a run does: every execution's duration, status, calls, tokens, evaluation and reward.

A workload is fixed before any policy runs, so all policies face the same executions for a seed (and the
lower bound is computed on exactly those). It is either sampled from a scenario or read back from a log.

Durations: a task's difficulty (shared by its group of rollouts) and the rollout's own luck are lognormal;
a share of tasks stall, and their rollouts may run until the timeout, which gives the point mass there.
Each step draws from its own seeded stream, so ``--steps`` changes nothing about the steps it keeps.
"""

from dataclasses import dataclass

import numpy as np

from gyre.sim.scenario import Scenario


@dataclass(frozen=True, slots=True)
class ExecutionSpec:
    execution_id: str
    task_id: str
    group_id: str
    step: int
    duration_s: float
    status: str
    """completed | timed_out | harness_error"""
    calls: int
    tokens: int
    eval_s: float
    eval_failed: bool
    reward: float

    @property
    def trained(self) -> bool:
        """Contributes training data: evaluated (timed-out runs are scored on their workspace)."""
        return self.status != "harness_error" and not self.eval_failed


@dataclass(frozen=True)
class Workload:
    batches: tuple[tuple[ExecutionSpec, ...], ...]
    """One batch per train step, in queue order (groups contiguous)."""

    @property
    def steps(self) -> int:
        return len(self.batches)

    def executions(self) -> list[ExecutionSpec]:
        return [e for batch in self.batches for e in batch]


def sample_workload(scenario: Scenario, seed: int, steps: int | None = None) -> Workload:
    steps = scenario.steps if steps is None else steps
    return Workload(tuple(_sample_batch(scenario, seed, step, steps) for step in range(steps)))


def _sample_batch(sc: Scenario, seed: int, step: int, steps: int) -> tuple[ExecutionSpec, ...]:
    r, b = sc.rollout, sc.batch
    rng = np.random.default_rng([seed, step])
    shape = (b.groups, b.group_size)
    task = rng.standard_normal(b.groups)[:, None]
    luck = rng.standard_normal(shape)
    duration = r.median_s * np.exp(r.task_sigma * task + r.rollout_sigma * luck)
    stalling = (rng.random(b.groups) < r.stall_task_share)[:, None]
    stalled = stalling & (rng.random(shape) < r.stall_prob)
    duration = np.where(stalled, r.timeout_s, np.minimum(duration, r.timeout_s))
    timed_out = duration >= r.timeout_s
    crashed = rng.random(shape) < r.harness_error_rate
    duration = np.where(crashed, duration * rng.uniform(0.05, 1.0, shape), duration)
    tokens = r.tokens_per_s * duration
    if r.max_tokens is not None:
        tokens = np.minimum(tokens, r.max_tokens)
    tokens = tokens * np.exp(r.token_sigma * rng.standard_normal(shape) - r.token_sigma**2 / 2)
    calls = np.clip(np.ceil(duration / r.sim_call_s), 1, r.max_sim_calls).astype(int)
    e = sc.evaluation
    eval_s = e.median_s * np.exp(e.sigma * rng.standard_normal(shape))
    eval_failed = rng.random(shape) < e.failure_rate
    progress = step / max(1, steps - 1)
    mean = sc.reward.start + (sc.reward.end - sc.reward.start) * progress
    reward = rng.beta(max(1e-3, 4 * mean), max(1e-3, 4 * (1 - mean)), shape)
    out = []
    for g in range(b.groups):
        group_id = f"s{step:03d}-g{g:03d}"
        for i in range(b.group_size):
            status = "harness_error" if crashed[g, i] else "timed_out" if timed_out[g, i] else "completed"
            out.append(ExecutionSpec(
                execution_id=f"{group_id}-r{i:02d}", task_id=f"task-{step:03d}-{g:03d}", group_id=group_id,
                step=step, duration_s=round(float(duration[g, i]), 3), status=status, calls=int(calls[g, i]),
                tokens=int(tokens[g, i]), eval_s=round(float(eval_s[g, i]), 3), eval_failed=bool(eval_failed[g, i]),
                reward=round(float(reward[g, i]), 4)))
    return tuple(out)
