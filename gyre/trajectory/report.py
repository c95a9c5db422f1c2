"""Counts of everything a build kept, excluded or dropped, so that no datum disappears silently."""

from dataclasses import asdict, dataclass, field
from typing import Any

from gyre.trajectory.config import TrajectoryConfig

MAX_EXAMPLES = 20


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

    @classmethod
    def for_config(cls, config: TrajectoryConfig) -> "BuildReport":
        return cls(cap=config.cap, form=config.form)

    def malformed(self, message: str) -> None:
        self.excluded_malformed += 1
        if len(self.malformed_examples) < MAX_EXAMPLES:
            self.malformed_examples.append(message)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["forward_token_reduction_packed_vs_expanded"] = (
            1 - self.tokens_tree_packed / self.tokens_expanded if self.tokens_expanded else 0.0
        )
        return out
