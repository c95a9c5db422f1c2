"""Ranking, the cap, ownership of shared tokens, and redundancy — on trees with known answers."""

from typing import get_args

import numpy as np
import pytest
from trajectory_helpers import branchy, call, calls

from gyre.events.fields import BranchKind
from gyre.trajectory import BRANCHES, CallTree, select


def ids(tree, ends) -> list[str]:
    return [tree.calls.call_ids[e] for e in ends]


def test_rank_is_branch_then_new_tokens_then_seq() -> None:
    tree = branchy()
    selection = select(tree, cap=None)
    # main: m4's path trains 3 new tokens, fail's 3 (3, 4 and 6) -> tie broken by seq ("fail" first).
    assert ids(tree, selection.kept) == ["fail", "m4", "sum", "s2", "ssum"]
    assert selection.trained.tolist() == [3, 3, 5, 6, 5]
    assert selection.policy_tokens_trained == tree.calls.num_policy_tokens


def test_cap_keeps_the_best_ranked_and_counts_the_rest() -> None:
    tree = branchy()
    selection = select(tree, cap=2)
    assert ids(tree, selection.kept) == ["fail", "m4"]
    assert ids(tree, selection.capped_ends) == ["sum", "ssum", "s2"]
    assert selection.redundant == 0 and selection.trajectories == 5
    for cap in range(1, 6):
        assert select(tree, cap).kept.tolist() == select(tree, None).kept.tolist()[:cap]


def test_shared_policy_tokens_are_owned_by_the_first_kept_trajectory() -> None:
    tree = branchy()
    selection = select(tree, cap=None)
    m1 = 0
    # "fail" (rank 0) owns m1's output [3, 4]; "sum" (rank 2) shares them and owns only m2 and its own output.
    assert (selection.lo[0, m1], selection.hi[0, m1]) == (2, 4)
    assert selection.hi[2, m1] == selection.lo[2, m1]
    m2 = 2
    assert (selection.lo[2, m2], selection.hi[2, m2]) == (0, 2)


def test_context_is_never_owned() -> None:
    tree = branchy()
    selection = select(tree, cap=None)
    owns = selection.hi > selection.lo
    assert (selection.lo >= tree.calls.delta_len[None, :])[owns].all()


def test_a_trajectory_without_new_policy_tokens_is_redundant() -> None:
    tree = CallTree.build(
        calls(
            call("a", delta=[1], out=[2, 3]),
            call("tool-only", parent="a", prefix=3, delta=[4, 5]),  # a leaf that adds context only
            call("b", parent="a", prefix=3, delta=[6], out=[7]),
        )
    )
    selection = select(tree, cap=5)
    assert ids(tree, selection.kept) == ["b"]
    assert ids(tree, selection.redundant_ends) == ["tool-only"]
    assert selection.tokens_packed == 5  # the redundant branch costs no forward tokens


def test_cover_and_forward_token_counts() -> None:
    tree = branchy()
    selection = select(tree, cap=None)
    assert selection.tokens_packed == tree.calls.num_tokens
    assert selection.tokens_expanded == selection.tokens_expanded_all == sum(tree.full_len[tree.ends])
    assert selection.tokens_packed < selection.tokens_expanded


@pytest.mark.parametrize("cap", [1, 3, None])
def test_ownership_ranges_are_disjoint_and_within_cover(cap: int | None) -> None:
    selection = select(branchy(), cap)
    counts = np.zeros_like(selection.cover)
    for r in range(len(selection.kept)):
        counts += selection.hi[r] - selection.lo[r]
        assert (selection.hi[r] <= selection.cover).all()
    assert counts.sum() == selection.policy_tokens_trained


def test_the_ranking_places_every_branch_kind_of_the_vocabulary() -> None:
    assert sorted(BRANCHES) == sorted(get_args(BranchKind))
    assert BRANCHES == ("main", "main-summary", "sub-agent", "sub-agent-summary")
