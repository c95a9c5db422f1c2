"""A lower bound on any policy's makespan for a workload: max(total work / total capacity, critical path).

Work: every execution holds 1/slots of a cell for its duration; every micro-step holds a cell; the
optimizer holds the core. Critical path: batch ``s`` cannot start before version ``s - staleness`` is
published, its data is not complete before its slowest execution plus evaluation, the step cannot end
before its cheapest micro-step trains after that and the optimizer after it, and the next version is only
published ``publish_s`` later. Switching costs and slot limits are ignored, so no policy can beat it.
With load-dependent decode an execution can run faster than its sampled (full-cell) duration: the work
term divides by the fastest rate a full cell reaches (empty contexts), the critical path by the fastest
rate of a lone request, and the optimizer is counted without the all-reduce (one contributing cell); with
``shard_optimizer`` the critical path's optimizer step is split over every cell (its work is the same).
In per-call mode (``[calls] simulate``) an execution is no faster than its calls' waits and prefill plus its
output decoded alone with no context, or its timeout (``CallTiming.fastest_s``), on any cell.
With partial rollouts a step need not wait for its own batch: every group of batch ``s`` is trained by
step ``s + 1`` at the latest (the due rule) and was queued no earlier than version ``s - 1 - staleness``
(over-sampled with the batch before), so the critical path makes step ``s + 1`` wait for batch ``s``.
"""

from dataclasses import dataclass, replace

from gyre.sim.calls import CallTiming, plan_calls
from gyre.sim.rollouts import DecodeCurve
from gyre.sim.scenario import Scenario
from gyre.sim.workload import ExecutionSpec, Workload


@dataclass(frozen=True)
class Bound:
    work_s: float
    critical_path_s: float

    @property
    def seconds(self) -> float:
        return max(self.work_s, self.critical_path_s)


def lower_bound(scenario: Scenario, workload: Workload, staleness: int, partial: bool = False,
                seed: int = 0) -> Bound:
    """``seed``: the workload's, which per-call plans are drawn with."""
    cluster, training = scenario.cluster, scenario.training
    curve = DecodeCurve(scenario)
    full_rate, lone_rate = curve.rate(cluster.slots_per_cell, 0), curve.rate(1, 0)
    if scenario.calls.simulate:
        timing = CallTiming(scenario)
        fastest = {e.execution_id: timing.fastest_s(plan_calls(scenario, e, seed, timing))
                   for e in workload.executions()}
        full_rate = lone_rate = 1.0
        workload = Workload(tuple(tuple(replace(e, duration_s=fastest[e.execution_id]) for e in batch)
                                  for batch in workload.batches))
    s_per_mtoken = training.cell_s_per_mtoken(cluster.gpus_per_cell)
    # sharded: at best every cell holds a shard that never moves, and no all-reduce
    optimizer_s = training.optimizer_step_s(1, cluster.cells if training.shard_optimizer else 1)
    work = 0.0
    published = [0.0]  # time version v is on the rollout engines
    train_end = 0.0
    previous_ready = 0.0  # partial rollouts: when the batch before this step's own was complete
    for step, batch in enumerate(workload.batches):
        work += sum(e.duration_s for e in batch) / cluster.slots_per_cell / full_rate
        group_s = _group_costs(batch, s_per_mtoken)
        work += sum(group_s) + training.optimizer_s
        start = published[max(0, step - staleness - (1 if partial else 0))]
        ready = start + max(e.duration_s / lone_rate + (0.0 if e.status == "harness_error" else e.eval_s)
                            for e in batch)
        last_micro = min(group_s) / scenario.batch.micro_steps_per_group
        waits_for = previous_ready if partial else ready
        if partial and step == len(workload.batches) - 1:
            waits_for = max(previous_ready, ready)  # the last step trains whatever is left
        train_end = max(waits_for, train_end) + last_micro + optimizer_s
        published.append(train_end + training.publish_s)
        previous_ready = ready
    return Bound(work_s=work / cluster.cells, critical_path_s=published[-1])


def _group_costs(batch: tuple[ExecutionSpec, ...], s_per_mtoken: float) -> list[float]:
    """Training seconds of each group on one cell (a micro-step holds at least one group)."""
    tokens: dict[str, int] = {}
    for e in batch:
        tokens[e.group_id] = tokens.get(e.group_id, 0) + (e.tokens if e.trained else 0)
    return [t / 1e6 * s_per_mtoken for t in tokens.values()]
