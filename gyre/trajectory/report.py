"""Counts of everything a build kept, excluded or dropped, so that no datum disappears silently."""

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from gyre.trajectory.config import TrajectoryConfig

MAX_EXAMPLES = 20


@dataclass
class Moments:
    """Count, mean, population std, min and max of a stream of numbers, kept as sums (mergeable, O(1))."""

    count: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    min: float | None = None
    max: float | None = None

    def add(self, values: Iterable[float]) -> None:
        for value in values:
            value = float(value)
            self.count += 1
            self.total += value
            self.total_sq += value * value
            self.min = value if self.min is None else min(self.min, value)
            self.max = value if self.max is None else max(self.max, value)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    @property
    def std(self) -> float | None:
        if not self.count:
            return None
        mean = self.total / self.count
        return math.sqrt(max(0.0, self.total_sq / self.count - mean * mean))

    def summary(self) -> dict[str, float | int | None]:
        return {"count": self.count, "mean": self.mean, "std": self.std, "min": self.min, "max": self.max}


@dataclass
class BuildReport:
    """Running totals of one build; ``to_dict`` is what ``gyre trajectories build --json`` prints."""

    cap: int | None = None
    form: str = "packed"
    executions: int = 0
    """Executions the log mentions (queued, called a model, finished or evaluated)."""
    executions_used: int = 0
    groups: int = 0
    groups_used: int = 0
    groups_dropped: int = 0
    """Groups with fewer valid executions than ``min_valid_per_group``."""
    groups_pending: int = 0
    """Groups not built yet: some member still runs or awaits its evaluation."""
    groups_zero_variance: int = 0
    """Used groups whose rewards are all equal: their advantages are 0."""
    excluded_eval_errors: int = 0
    excluded_harness_errors: int = 0
    excluded_pending: int = 0
    excluded_unknown_group: int = 0
    excluded_no_calls: int = 0
    excluded_no_policy_tokens: int = 0
    excluded_malformed: int = 0
    excluded_in_dropped_groups: int = 0
    timed_out_scored: int = 0
    trajectories_total: int = 0
    trajectories_kept: int = 0
    trajectories_capped: int = 0
    trajectories_redundant: int = 0
    policy_tokens_total: int = 0
    policy_tokens_trained: int = 0
    policy_tokens_dropped_by_cap: int = 0
    tokens_total: int = 0
    """Unique tokens of the used executions (= tree-packed forward tokens without a cap)."""
    tokens_expanded_uncapped: int = 0
    tokens_expanded: int = 0
    tokens_tree_packed: int = 0
    micro_batches: int = 0
    micro_batch_tokens: int = 0
    micro_batch_forward_bound: int = 0
    """Tokens the trainer forwards at most: ``micro_batch_tokens`` less the leading prompts that rows of one
    micro-batch share (``share_prefixes``; equal to ``micro_batch_tokens`` without it)."""
    oversized_rows: int = 0
    """Rows longer than the token budget, each emitted alone in its own micro-batch."""
    malformed_examples: list[str] = field(default_factory=list)
    rewards: Moments = field(default_factory=Moments)
    """Rewards of the used executions."""
    group_reward_std: Moments = field(default_factory=Moments)
    """Within-group reward std (population) of each used group: 0 means the group teaches nothing."""
    advantages: Moments = field(default_factory=Moments)
    """Advantages of the used executions."""
    response_tokens: Moments = field(default_factory=Moments)
    """Policy-generated tokens of each used execution (all its calls' outputs): the response length."""

    @classmethod
    def for_config(cls, config: TrajectoryConfig) -> "BuildReport":
        return cls(cap=config.cap, form=config.form)

    def malformed(self, message: str) -> None:
        self.excluded_malformed += 1
        if len(self.malformed_examples) < MAX_EXAMPLES:
            self.malformed_examples.append(message)

    def step_metrics(self) -> dict[str, Any]:
        """The batch statistics a ``train_step_finished`` event carries (field name -> value)."""
        return {
            "reward_mean": self.rewards.mean,
            "reward_std": self.rewards.std,
            "group_reward_std": self.group_reward_std.mean,
            "groups_zero_variance": self.groups_zero_variance,
            "advantage_mean": self.advantages.mean,
            "advantage_std": self.advantages.std,
            "advantage_min": self.advantages.min,
            "advantage_max": self.advantages.max,
            "response_tokens_mean": self.response_tokens.mean,
            "response_tokens_max": None if self.response_tokens.max is None else int(self.response_tokens.max),
        }

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name, value in vars(self).items():
            if isinstance(value, Moments):
                out[name] = value.summary()
        out["forward_token_reduction_packed_vs_expanded"] = (
            1 - self.tokens_tree_packed / self.tokens_expanded if self.tokens_expanded else 0.0
        )
        return out
