"""Options of the trajectory processor, validated once when built."""

from dataclasses import dataclass
from typing import Literal

from gyre.trajectory.errors import TrajectoryConfigError

BatchForm = Literal["packed", "expanded"]


@dataclass(frozen=True, kw_only=True)
class TrajectoryConfig:
    """How executions become training batches.

    ``cap`` bounds the trajectories kept per execution (the brief's bounded sampling; ``None`` keeps all,
    for comparison). ``min_valid_per_group`` is the fewest scored executions a GSPO group needs: fewer and
    its advantages mean nothing, so the group is dropped. ``total_weight`` is what the token weights of
    every execution add up to, whatever its number of branches. ``token_budget`` bounds the tokens of a
    micro-batch; with ``share_prefixes`` (packed form) it bounds the tokens the trainer *forwards*: rows of
    one group that start with the same prompt count it once, since the trainer merges their context
    (``gyre.trajectory.share``). The budget is what bounds a micro-batch's training memory.
    ``micro_steps_per_group`` (``None``: the budget alone cuts) cuts each group into exactly that many
    micro-batches instead, balanced by tokens (some empty when a group has fewer rows): the simulator's
    model, and what a streamed train step needs to know its plan before its last group completes.
    """

    cap: int | None = 5
    min_valid_per_group: int = 2
    advantage_eps: float = 1e-6
    total_weight: float = 1.0
    token_budget: int = 1 << 20
    form: BatchForm = "packed"
    share_prefixes: bool = True
    micro_steps_per_group: int | None = None
    strict: bool = False
    """Raise on a malformed execution instead of excluding and counting it."""
    shuffle_rewards: bool = False
    """A control, never for real training: each group's rewards are permuted among its executions (seeded by
    the group id) before advantages, so a gain that survives it is not the reward's."""
    reward_threshold: float | None = None
    """Pass/fail training: each reward becomes 1.0 at or above it and 0.0 below it before advantages (and in
    the report's rewards), so a graded partial-credit reward trains on what a held-out pass rate measures."""

    def __post_init__(self) -> None:
        if self.cap is not None and self.cap < 1:
            raise TrajectoryConfigError(f"cap must be >= 1 or None (uncapped), got {self.cap}")
        if self.min_valid_per_group < 1:
            raise TrajectoryConfigError(f"min_valid_per_group must be >= 1, got {self.min_valid_per_group}")
        if not self.advantage_eps > 0:
            raise TrajectoryConfigError(f"advantage_eps must be > 0, got {self.advantage_eps}")
        if not self.total_weight > 0:
            raise TrajectoryConfigError(f"total_weight must be > 0, got {self.total_weight}")
        if self.token_budget < 1:
            raise TrajectoryConfigError(f"token_budget must be >= 1 token, got {self.token_budget}")
        if self.micro_steps_per_group is not None and self.micro_steps_per_group < 1:
            raise TrajectoryConfigError(f"micro_steps_per_group must be >= 1 or None, got {self.micro_steps_per_group}")
        if self.reward_threshold is not None and not 0 <= self.reward_threshold <= 1:
            raise TrajectoryConfigError(f"reward_threshold must be in [0, 1] or None, got {self.reward_threshold}")
        if self.form not in ("packed", "expanded"):
            raise TrajectoryConfigError(f"form must be 'packed' or 'expanded', got {self.form!r}")
