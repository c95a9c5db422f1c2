"""The run view: what a run host reports and waits on, folded from the log like every other projection.

One fold serves both topologies (one process, a cluster) and a resumed run alike, so the progress a user
sees, the summary at the end and the figures `gyre log sql` gives are the same numbers:

- per step: the executions queued for it and the version they were queued with, when the first was queued
  and the last finished, their rewards, and what training the step did (`train_step_finished`);
- per execution outside the steps (held-out evaluations): its outcome, a reward or excluded (an evaluator
  error or a harness error is never a reward), which is what a waiting evaluation resolves on;
- each cell's last role decision (a resumed run performs one that was under way again);
- every published version's file and every checkpoint (what a restarted core restores from), the version
  each cell's engine serves, run start and finish.
"""

from dataclasses import dataclass, field

from gyre.events.models import RoleSwitchRequested
from gyre.state.fold import Projection, on

EXCLUDED = None
"""An execution's outcome when it has no reward: the evaluator failed, or the harness did."""


@dataclass
class StepFacts:
    policy_version: int = 0
    """The version the step's executions were queued with."""
    executions: list[str] = field(default_factory=list)
    rewards: dict[str, float] = field(default_factory=dict)
    first_queued_us: int | None = None
    last_finished_us: int | None = None
    trained: bool = False
    produced_version: int = 0
    """The version the step's training produced (its own when it made no update)."""
    micro_steps: int = 0
    forwarded_tokens: int = 0
    trained_tokens: int = 0
    loss: float | None = None
    train_s: float = 0.0
    trained_us: int | None = None

    @property
    def rollout_s(self) -> float:
        if self.first_queued_us is None or self.last_finished_us is None:
            return 0.0
        return max(0.0, (self.last_finished_us - self.first_queued_us) / 1e6)

    @property
    def reward_mean(self) -> float | None:
        return sum(self.rewards.values()) / len(self.rewards) if self.rewards else None


@dataclass
class Weights:
    version: int
    location: str
    sha256: str


@dataclass
class Checkpoint:
    step: int
    policy_version: int
    location: str
    sha256: str


@dataclass
class RunState:
    run_id: str = ""
    started_us: int | None = None
    finished: str | None = None
    """The status of the last `run_finished` (a resumed run may have several)."""
    steps: dict[int, StepFacts] = field(default_factory=dict)
    step_of: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, float | None] = field(default_factory=dict)
    """Executions outside the steps (held-out) that are done: their reward, or None when excluded."""
    unstepped: set[str] = field(default_factory=set)
    published: dict[int, Weights] = field(default_factory=dict)
    """Every published version's file (a restarted core checks what it retrains against them)."""
    checkpoints: list[Checkpoint] = field(default_factory=list)
    engine_versions: dict[str, int] = field(default_factory=dict)
    """The version each cell's engine serves, as `weights_loaded` last said."""
    decisions: dict[str, dict] = field(default_factory=dict)
    """Each cell's last `role_switch_requested`, as its fields (a resumed run performs one under way again)."""
    emulation: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    """Each cell incarnation's last `emulation_reported` (cumulative figures of its emulated accelerator)."""

    def emulation_totals(self) -> dict[str, float] | None:
        """Every cell incarnation's emulated accelerator together, with the share of the wall time its work
        should have taken by which real compute overran it (None: nothing was emulated)."""
        if not self.emulation:
            return None
        keys = ("holds", "emulated_s", "real_s", "waited_s", "overrun_s", "overruns")
        totals = {k: sum(r[k] for r in self.emulation.values()) for k in keys}
        due = totals["real_s"] + totals["waited_s"] - totals["overrun_s"]
        totals["overrun_share"] = totals["overrun_s"] / due if due > 0 else 0.0
        return totals

    def decision(self, cell_id: str) -> RoleSwitchRequested | None:
        fields = self.decisions.get(cell_id)
        return None if fields is None else RoleSwitchRequested.model_validate(fields)

    @property
    def latest(self) -> Weights | None:
        return self.published[max(self.published)] if self.published else None


class RunView(Projection[RunState]):
    name = "run"
    version = 2  # emulation reports
    state_type = RunState

    @on("run_started", "run_id", "ts")
    def _started(self, s: RunState, run_id, ts) -> None:
        s.run_id, s.started_us = run_id, ts

    @on("run_finished", "status")
    def _finished(self, s: RunState, status) -> None:
        s.finished = status

    @on("execution_queued", "execution_id", "step", "policy_version", "ts")
    def _queued(self, s: RunState, execution_id, step, policy_version, ts) -> None:
        if step is None:
            s.unstepped.add(execution_id)
            s.outcomes.pop(execution_id, None)  # a new attempt: not done again yet
            return
        facts = s.steps.get(step)
        if facts is None:
            facts = s.steps[step] = StepFacts(policy_version or 0)
        if execution_id not in s.step_of:
            facts.executions.append(execution_id)
            s.step_of[execution_id] = step
        if facts.first_queued_us is None:
            facts.first_queued_us = ts

    @on("execution_finished", "execution_id", "status", "ts")
    def _execution_finished(self, s: RunState, execution_id, status, ts) -> None:
        step = s.step_of.get(execution_id)
        if step is not None:
            s.steps[step].last_finished_us = ts
        elif status == "harness_error" and execution_id in s.unstepped:
            s.outcomes[execution_id] = EXCLUDED

    @on("reward_recorded", "execution_id", "reward")
    def _reward(self, s: RunState, execution_id, reward) -> None:
        step = s.step_of.get(execution_id)
        if step is not None:
            s.steps[step].rewards[execution_id] = reward
        elif execution_id in s.unstepped:
            s.outcomes[execution_id] = reward

    @on("evaluation_failed", "execution_id")
    def _evaluation_failed(self, s: RunState, execution_id) -> None:
        if execution_id in s.unstepped:
            s.outcomes[execution_id] = EXCLUDED

    @on("train_step_finished", "step", "policy_version", "micro_steps", "tokens", "tokens_trained", "loss",
        "duration_s", "ts")
    def _trained(self, s: RunState, step, policy_version, micro_steps, tokens, tokens_trained, loss, duration_s,
                 ts) -> None:
        facts = s.steps.setdefault(step, StepFacts())
        facts.trained, facts.produced_version = True, policy_version
        facts.micro_steps, facts.forwarded_tokens = micro_steps, tokens
        facts.trained_tokens, facts.loss, facts.train_s, facts.trained_us = tokens_trained or 0, loss, duration_s, ts

    @on("weights_published", "policy_version", "location", "sha256")
    def _published(self, s: RunState, policy_version, location, sha256) -> None:
        s.published[policy_version] = Weights(policy_version, location, sha256)

    @on("checkpoint_saved", "step", "policy_version", "location", "sha256")
    def _checkpoint(self, s: RunState, step, policy_version, location, sha256) -> None:
        s.checkpoints.append(Checkpoint(step, policy_version, location, sha256))

    @on("role_switch_requested", "cell_id", "from_role", "to_role", "reason", "watermark", "redirects",
        "decided_at_seq")
    def _decided(self, s: RunState, cell_id, from_role, to_role, reason, watermark, redirects, decided_at_seq) -> None:
        s.decisions[cell_id] = {
            "cell_id": cell_id, "from_role": from_role, "to_role": to_role, "reason": reason, "watermark": watermark,
            "redirects": [r if isinstance(r, dict) else r.model_dump() for r in redirects],
            "decided_at_seq": decided_at_seq}

    @on("weights_loaded", "cell_id", "policy_version")
    def _loaded(self, s: RunState, cell_id, policy_version) -> None:
        s.engine_versions[cell_id] = policy_version

    @on("emulation_reported", "cell_id", "incarnation", "holds", "emulated_s", "real_s", "waited_s", "overrun_s",
        "overruns")
    def _emulated(self, s: RunState, cell_id, incarnation, holds, emulated_s, real_s, waited_s, overrun_s,
                  overruns) -> None:
        s.emulation[(cell_id, incarnation)] = {"holds": holds, "emulated_s": emulated_s, "real_s": real_s,
                                               "waited_s": waited_s, "overrun_s": overrun_s, "overruns": overruns}

    @on("cell_registered", "cell_id")
    def _registered(self, s: RunState, cell_id) -> None:
        s.engine_versions[cell_id] = 0  # a new incarnation's engine starts with the initial weights

    @on("cell_lost", "cell_id")
    def _lost(self, s: RunState, cell_id) -> None:
        s.engine_versions.pop(cell_id, None)  # unknown until its next incarnation registers
