"""From groups to micro-batches: classify executions, build trees, select, weight, normalise, emit.

The builder is the one place that decides what is excluded, and it counts every exclusion in its
``BuildReport``. It does no I/O: groups come from ``gyre.trajectory.source`` (or from tests).
"""

import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from gyre.trajectory.batches import ExecutionPlan, MicroBatch, micro_batches
from gyre.trajectory.calls import ExecutionCalls
from gyre.trajectory.config import TrajectoryConfig
from gyre.trajectory.errors import TrajectoryError
from gyre.trajectory.groups import Group, Member
from gyre.trajectory.report import BuildReport
from gyre.trajectory.rewards import advantages
from gyre.trajectory.selection import Selection, select
from gyre.trajectory.tree import CallTree


class BatchBuilder:
    """Turns complete GSPO groups into micro-batches, counting everything it leaves out."""

    def __init__(self, config: TrajectoryConfig | None = None) -> None:
        self.config = config or TrajectoryConfig()
        self.report = BuildReport.for_config(self.config)
        self._next_index = 0

    def from_log(self, path: str | Path) -> Iterator[MicroBatch]:
        """Micro-batches of every complete group of a log, emitted as each group is read in full."""
        from gyre.trajectory.source import LogSource

        yield from self.batches(LogSource(path).groups())

    def batches(self, groups: Iterable[Group]) -> Iterator[MicroBatch]:
        for group in groups:
            yield from self.group_batches(group)

    def group_batches(self, group: Group) -> Iterator[MicroBatch]:
        """The group's micro-batches: ``micro_steps_per_group`` of them when set (even for a group left out,
        so a step's plan is its groups times that), else as many as the token budget needs."""
        plans = self.plan(group)
        for batch, oversized in micro_batches(
            plans, self.config.form, self.config.token_budget, self._next_index, share=self.config.share_prefixes,
            parts=self.config.micro_steps_per_group,
        ):
            self._next_index += 1
            self.report.micro_batches += 1
            self.report.micro_batch_tokens += batch.tokens
            self.report.micro_batch_forward_bound += batch.forward_bound
            self.report.oversized_rows += int(oversized)
            yield batch

    def plan(self, group: Group) -> list[ExecutionPlan]:
        """Valid executions of ``group`` with their selections and advantages (empty if the group is out)."""
        report = self.report
        report.executions += len(group.members)
        if group.group_id is None:
            report.excluded_unknown_group += len(group.members)
            return []
        report.groups += 1
        if group.pending:
            report.groups_pending += 1
            report.excluded_pending += len(group.members)
            return []
        valid: list[tuple[Member, Selection]] = []
        for member in group.members:
            selection = self._select(member)
            if selection is not None:
                valid.append((member, selection))
        if len(valid) < self.config.min_valid_per_group:
            report.groups_dropped += 1
            report.excluded_in_dropped_groups += len(valid)
            return []
        rewards = np.array([member.outcome.reward for member, _ in valid], dtype=np.float64)
        if self.config.reward_threshold is not None:
            rewards = (rewards >= self.config.reward_threshold).astype(np.float64)
        if np.all(rewards == rewards[0]):
            report.groups_zero_variance += 1
        report.groups_used += 1
        report.rewards.add(rewards)
        report.group_reward_std.add([rewards.std()])
        if self.config.shuffle_rewards:
            rewards = np.random.default_rng(zlib.crc32(group.group_id.encode())).permutation(rewards)
        group_advantages = advantages(rewards, self.config.advantage_eps)
        report.advantages.add(group_advantages)
        plans = []
        for (member, selection), advantage in zip(valid, group_advantages, strict=True):
            plans.append(
                ExecutionPlan(
                    member.outcome,
                    selection,
                    float(advantage),
                    self.config.total_weight / selection.policy_tokens_trained,
                )
            )
            self._count(member, selection)
        return plans

    def _select(self, member: Member) -> Selection | None:
        """The member's selection if it is valid; otherwise count why not and return ``None``."""
        report, outcome = self.report, member.outcome
        verdict = outcome.verdict
        if verdict == "eval_error":
            report.excluded_eval_errors += 1
            return None
        if verdict == "harness_error":
            report.excluded_harness_errors += 1
            return None
        if outcome.calls == 0 or member.calls is None:
            report.excluded_no_calls += 1
            return None
        try:
            calls = member.calls
            if isinstance(calls, TrajectoryError):
                raise calls
            if isinstance(calls, list):
                calls = ExecutionCalls.from_fragments(outcome.execution_id, calls)
            elif not isinstance(calls, ExecutionCalls):
                calls = ExecutionCalls.from_arrow(outcome.execution_id, calls)
            selection = select(CallTree.build(calls), self.config.cap)
        except TrajectoryError as error:
            if self.config.strict:
                raise
            report.malformed(str(error))
            return None
        if selection.policy_tokens_trained == 0:
            report.excluded_no_policy_tokens += 1
            return None
        return selection

    def _count(self, member: Member, selection: Selection) -> None:
        report = self.report
        report.executions_used += 1
        report.timed_out_scored += int(member.outcome.timed_out_scored)
        calls = selection.tree.calls
        report.trajectories_total += selection.trajectories
        report.trajectories_kept += len(selection.kept)
        report.trajectories_capped += selection.capped
        report.trajectories_redundant += selection.redundant
        report.policy_tokens_total += calls.num_policy_tokens
        report.response_tokens.add([calls.num_policy_tokens])
        report.policy_tokens_trained += selection.policy_tokens_trained
        report.policy_tokens_dropped_by_cap += calls.num_policy_tokens - selection.policy_tokens_trained
        report.tokens_total += calls.num_tokens
        report.tokens_expanded_uncapped += selection.tokens_expanded_all
        report.tokens_expanded += selection.tokens_expanded
        report.tokens_tree_packed += selection.tokens_packed


def build(groups: Iterable[Group], config: TrajectoryConfig | None = None) -> tuple[list[MicroBatch], BuildReport]:
    """All micro-batches of ``groups`` at once (tests, small runs); stream with ``BatchBuilder`` otherwise."""
    builder = BatchBuilder(config)
    return list(builder.batches(groups)), builder.report
