"""Invariants on random trees: trained once, context never trained, equal weights, packed == expanded."""

from collections import defaultdict
from itertools import count, pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trajectory_helpers import ancestors_mask, call, calls, interval_mask, outcome, rows, trained

from gyre.trajectory import BRANCHES, CallTree, ExecutionCalls, Group, Member, TrajectoryConfig, build

CAPS = [1, 2, 3, 5, None]


@st.composite
def execution(draw: st.DrawFn, execution_id: str, ids: count) -> ExecutionCalls:
    """A random call tree: any parent, any prefix of it, short segments of distinct token ids."""
    n = draw(st.integers(1, 10))
    events, full = [], []
    for i in range(n):
        parent = draw(st.none() | st.integers(0, i - 1)) if i else None
        prefix = draw(st.integers(0, full[parent])) if parent is not None else 0
        delta = [next(ids) for _ in range(draw(st.integers(0, 3)))]
        out = [next(ids) for _ in range(draw(st.integers(0, 3)))]
        events.append(
            call(
                f"c{i}",
                parent=None if parent is None else f"c{parent}",
                prefix=prefix,
                delta=delta,
                out=out,
                branch=draw(st.sampled_from(BRANCHES)),
                version=draw(st.integers(0, 2)),
                execution=execution_id,
                seq=i,
            )
        )
        full.append(prefix + len(delta) + len(out))
    order = draw(st.permutations(range(n)))  # arrival order need not be seq order
    return calls(*[events[k] for k in order])


@st.composite
def groups(draw: st.DrawFn) -> Group:
    ids = count(1)
    members = []
    for k in range(draw(st.integers(1, 4))):
        name = f"e{k}"
        failed = draw(st.booleans()) and k > 0
        reward = None if failed else draw(st.sampled_from([0.0, 0.25, 1.0]))
        members.append(
            Member(outcome(name, reward=reward, error="crash" if failed else None), draw(execution(name, ids)))
        )
    return Group("g1", tuple(members))


def by_execution(batch_rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for row in batch_rows:
        out[row["execution_id"]].append(row)
    return out


@settings(max_examples=150, deadline=None)
@given(group=groups(), cap=st.sampled_from(CAPS), budget=st.sampled_from([4, 16, 1 << 20]))
def test_invariants(group: Group, cap: int | None, budget: int) -> None:
    config = TrajectoryConfig(cap=cap, min_valid_per_group=1, token_budget=budget)
    packed_batches, report = build([group], config)
    expanded_batches, expanded_report = build(
        [group], TrajectoryConfig(cap=cap, min_valid_per_group=1, token_budget=budget, form="expanded")
    )
    packed, expanded = by_execution(rows(packed_batches)), by_execution(rows(expanded_batches))
    members = {m.outcome.execution_id: m for m in group.members}

    # Evaluation errors never produce rows (and so never a reward of 0).
    for name, member in members.items():
        if member.outcome.eval_error is not None:
            assert name not in packed and name not in expanded
    assert report.excluded_eval_errors == sum(m.outcome.eval_error is not None for m in group.members)

    for name, rows_of in expanded.items():
        member_calls = members[name].calls
        assert isinstance(member_calls, ExecutionCalls)
        policy = set(member_calls.tokens[member_calls.policy_mask()].tolist())
        assert cap is None or len(rows_of) <= cap  # cap respected

        # Each policy token of a kept trajectory is trained exactly once; no context token is trained.
        owners: dict[int, int] = {}
        for row in rows_of:
            for token in trained(row):
                assert token not in owners, f"token {token} trained twice"
                owners[token] = row["trajectory_index"]
        on_kept_paths = {t for row in rows_of for t in row["input_ids"]}
        assert set(owners) == on_kept_paths & policy
        if cap is None:
            assert set(owners) == policy

        # Every execution's trained tokens carry the same total weight.
        (tree_row,) = packed[name]
        assert sum(tree_row["token_weights"]) == pytest.approx(config.total_weight, rel=1e-5)
        assert sum(w for row in rows_of for w in row["token_weights"]) == pytest.approx(config.total_weight, rel=1e-5)

        # The packed tree holds exactly the unique tokens of the expanded rows, with the same training.
        assert len(tree_row["input_ids"]) == len(set(tree_row["input_ids"])) == len(on_kept_paths)
        assert set(tree_row["input_ids"]) == on_kept_paths
        assert trained(tree_row) == {t: w for row in rows_of for t, w in trained(row).items()}

        # Tree structure: parents first, positions are depths, both mask encodings agree.
        parents = tree_row["parent_ids"]
        assert all(p < i for i, p in enumerate(parents))
        depth = [0 if p < 0 else None for p in parents]
        for i, p in enumerate(parents):
            if p >= 0:
                depth[i] = depth[p] + 1  # type: ignore[operator]
        assert tree_row["position_ids"] == depth
        np.testing.assert_array_equal(ancestors_mask(parents), interval_mask(tree_row["subtree_end"]))

    assert set(packed) == set(expanded)
    assert report.tokens_tree_packed == sum(len(r["input_ids"]) for r in rows(packed_batches))
    assert report.tokens_expanded == sum(len(r["input_ids"]) for r in rows(expanded_batches))
    assert report.policy_tokens_trained == expanded_report.policy_tokens_trained
    assert report.tokens_tree_packed <= report.tokens_expanded <= report.tokens_expanded_uncapped
    assert all(b.tokens <= budget or b.rows == 1 for b in packed_batches + expanded_batches)


@settings(max_examples=60, deadline=None)
@given(group=groups())
def test_a_larger_cap_keeps_a_superset(group: Group) -> None:
    kept = []
    for cap in [1, 2, 3, None]:
        batches, _ = build([group], TrajectoryConfig(cap=cap, min_valid_per_group=1, form="expanded"))
        kept.append({(r["execution_id"], tuple(r["input_ids"])) for r in rows(batches)})
    assert all(a <= b for a, b in pairwise(kept))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_spans_rebuild_every_full_sequence(data: st.DataObject) -> None:
    c = data.draw(execution("e1", count(1)))
    tree = CallTree.build(c)
    full: dict[int, list[int]] = {}

    def naive(i: int) -> list[int]:  # the definition: parent's first prefix_len tokens, then the segment
        if i not in full:
            prefix = naive(int(c.parent[i]))[: c.prefix_len[i]] if c.parent[i] >= 0 else []
            full[i] = prefix + c.tokens[c.seg_start[i] : c.seg_start[i + 1]].tolist()
        return full[i]

    for i in range(c.n):
        assert tree.sequence(i).tolist() == naive(i)
    covered = {t for e in tree.ends.tolist() for t in tree.sequence(e).tolist()}
    assert covered == set(c.tokens.tolist())  # every recorded token lies on some trajectory
