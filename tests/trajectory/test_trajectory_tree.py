"""Hand-built trees with known answers: shared prefixes, retries, compaction roots, sub-agents, bad input."""

import numpy as np
import pyarrow as pa
import pytest
from trajectory_helpers import call, calls

from gyre.trajectory import CallTree, ExecutionCalls, TrajectoryError
from gyre.trajectory.calls import CallFragment


def full_sequence(tree: CallTree, end: int) -> list[int]:
    """A trajectory's tokens, from its spans, checked against the ``used`` matrix the selection uses."""
    c = tree.calls
    used = tree.used(np.array([end]))[0]
    from_used = [t for node in tree.path(end) for t in c.tokens[c.seg_start[node] : c.seg_start[node] + used[node]]]
    assert tree.sequence(end).tolist() == from_used
    assert len(from_used) == tree.full_len[end]
    return from_used


def test_segments_interleave_context_and_policy_tokens() -> None:
    c = calls(call("a", delta=[1, 2, 3], out=[4, 5]), call("b", parent="a", prefix=5, delta=[6], out=[7, 8]))
    assert c.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert c.seg_start.tolist() == [0, 5, 8]
    assert c.delta_len.tolist() == [3, 1]
    assert c.logprobs.tolist() == pytest.approx([-0.004, -0.005, -0.007, -0.008])
    assert c.token_logprobs().tolist() == pytest.approx([0, 0, 0, -0.004, -0.005, 0, -0.007, -0.008])
    assert c.policy_mask().tolist() == [False, False, False, True, True, False, True, True]
    assert c.num_policy_tokens == 4


def test_linear_chain_is_one_trajectory() -> None:
    tree = CallTree.build(
        calls(
            call("a", delta=[1, 2, 3], out=[4, 5]),
            call("b", parent="a", prefix=5, delta=[6], out=[7, 8]),
            call("c", parent="b", prefix=8, delta=[9], out=[10]),
        )
    )
    assert tree.ends.tolist() == [2]
    assert full_sequence(tree, 2) == list(range(1, 11))
    assert tree.owner.tolist() == [-1, 0, 1]
    assert tree.attach.tolist() == [-1, 4, 2]


def test_sibling_retries_share_the_parent_prefix() -> None:
    tree = CallTree.build(
        calls(
            call("a", delta=[1, 2], out=[3]),
            call("b1", parent="a", prefix=3, delta=[4], out=[5, 6]),
            call("b2", parent="a", prefix=3, delta=[4], out=[7]),
        )
    )
    assert tree.ends.tolist() == [1, 2]
    assert full_sequence(tree, 1) == [1, 2, 3, 4, 5, 6]
    assert full_sequence(tree, 2) == [1, 2, 3, 4, 7]


def test_retry_recorded_through_the_failed_call_branches_mid_segment() -> None:
    # The failed call's prompt is the retry's whole prompt: prefix_len stops inside the failed call.
    tree = CallTree.build(
        calls(
            call("a", delta=[1, 2], out=[3]),
            call("failed", parent="a", prefix=3, delta=[4, 5], out=[6, 7]),
            call("retry", parent="failed", prefix=5, out=[8, 9]),
        )
    )
    assert tree.owner.tolist() == [-1, 0, 1]
    assert tree.attach.tolist() == [-1, 2, 1]  # the retry follows token 5, the failed call's last delta token
    assert tree.ends.tolist() == [1, 2]
    assert full_sequence(tree, 1) == [1, 2, 3, 4, 5, 6, 7]
    assert full_sequence(tree, 2) == [1, 2, 3, 4, 5, 8, 9]


def test_prefix_shorter_than_the_parents_own_prefix_resolves_to_an_ancestor() -> None:
    tree = CallTree.build(
        calls(
            call("a", delta=[1, 2, 3], out=[4, 5]),
            call("b", parent="a", prefix=5, delta=[6, 7], out=[8]),
            call("c", parent="b", prefix=4, out=[9]),  # shares only [1, 2, 3, 4]: held by "a"
        )
    )
    assert tree.owner[2] == 0 and tree.attach[2] == 3
    assert full_sequence(tree, 2) == [1, 2, 3, 4, 9]
    assert sorted(tree.ends.tolist()) == [1, 2]


def test_compaction_starts_a_new_root_and_the_summary_ends_the_old_context() -> None:
    tree = CallTree.build(
        calls(
            call("m1", delta=[1, 2], out=[3]),
            call("m2", parent="m1", prefix=3, delta=[4], out=[5]),
            call("sum", parent="m2", prefix=5, delta=[6], out=[7, 8], branch="main-summary"),
            call("m3", delta=[1, 7, 8], out=[9]),  # a new root: the summary re-enters as context
            call("m4", parent="m3", prefix=4, delta=[10], out=[11]),
        )
    )
    assert tree.ends.tolist() == [2, 4]
    assert full_sequence(tree, 2) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert full_sequence(tree, 4) == [1, 7, 8, 9, 10, 11]


def test_sub_agent_is_its_own_root_and_preorder_keeps_subtrees_contiguous() -> None:
    tree = CallTree.build(
        calls(
            call("m1", delta=[1], out=[2]),
            call("s1", delta=[50], out=[51], branch="sub-agent"),
            call("s2", parent="s1", prefix=2, delta=[52], out=[53], branch="sub-agent"),
            call("m2", parent="m1", prefix=2, delta=[3], out=[4]),
        )
    )
    assert tree.ends.tolist() == [2, 3]
    order = tree.preorder.tolist()
    assert order == [0, 3, 1, 2]  # roots by seq, each followed by its subtree
    for node in range(4):
        inside = {order[p] for p in range(tree.position[node], tree.stop[node])}
        assert inside == ({0, 3} if node == 0 else {1, 2} if node == 1 else {node})


def test_children_are_laid_out_by_attach_offset_descending() -> None:
    tree = CallTree.build(
        calls(
            call("a", delta=[1, 2, 3], out=[4]),
            call("early", parent="a", prefix=1, out=[5]),
            call("late", parent="a", prefix=4, out=[6]),
        )
    )
    assert tree.preorder.tolist() == [0, 2, 1]


def test_the_full_sequence_of_any_call_is_prefix_plus_segment() -> None:
    events = [
        call("a", delta=[1, 2, 3], out=[4, 5]),
        call("b", parent="a", prefix=5, delta=[6, 7], out=[8]),
        call("c", parent="b", prefix=4, out=[9]),
        call("d", parent="b", prefix=8, delta=[10], out=[11]),
    ]
    tree = CallTree.build(calls(*events))
    full: dict[str, list[int]] = {}
    for i, event in enumerate(events):
        prefix = full[event.parent_call_id][: event.prefix_len] if event.parent_call_id else []
        full[event.call_id] = prefix + event.prompt_delta_ids + event.output_ids
        assert tree.sequence(i).tolist() == full[event.call_id]


def test_an_empty_leaf_does_not_hide_the_call_it_continues() -> None:
    tree = CallTree.build(calls(call("a", delta=[1], out=[2]), call("empty", parent="a", prefix=2)))
    assert tree.ends.tolist() == [0]


def test_empty_calls_are_not_trajectories_but_pass_their_prefix_on() -> None:
    tree = CallTree.build(
        calls(
            call("a", delta=[1], out=[2]),
            call("empty", parent="a", prefix=2),
            call("b", parent="empty", prefix=2, out=[3]),
        )
    )
    assert tree.ends.tolist() == [2]
    assert tree.owner[2] == 0
    assert full_sequence(tree, 2) == [1, 2, 3]


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([call("a", out=[1]), call("b", parent="zzz", prefix=1, out=[2])], "names parent 'zzz'"),
        ([call("a", out=[1]), call("b", parent="a", prefix=2, out=[2])], "longer than the full sequence"),
        ([call("a", out=[1]), call("a", out=[2])], "records call 'a' more than once"),
    ],
)
def test_bad_links_are_named(events: list, message: str) -> None:
    with pytest.raises(TrajectoryError, match=message):
        CallTree.build(calls(*events))


def _table(**overrides: list) -> pa.Table:
    columns = {
        "call_id": ["a", "b"],
        "parent_call_id": ["b", "a"],
        "branch": ["main", "main"],
        "prefix_len": [1, 1],
        "prompt_delta_ids": [[1], [2]],
        "output_ids": [[3], [4]],
        "output_logprobs": [[-0.1], [-0.2]],
        "policy_version": [0, 0],
        "seq": [0, 1],
    }
    columns.update(overrides)
    return pa.table(
        {
            **{k: v for k, v in columns.items() if k not in ("prompt_delta_ids", "output_ids", "output_logprobs")},
            "prompt_delta_ids": pa.array(columns["prompt_delta_ids"], pa.list_(pa.int32())),
            "output_ids": pa.array(columns["output_ids"], pa.list_(pa.int32())),
            "output_logprobs": pa.array(columns["output_logprobs"], pa.list_(pa.float32())),
        }
    )


def test_parent_cycles_are_refused() -> None:
    with pytest.raises(TrajectoryError, match="parent cycle"):
        CallTree.build(ExecutionCalls.from_arrow("e1", _table()))


def test_prefix_without_parent_is_refused() -> None:
    table = _table(parent_call_id=[None, None], prefix_len=[0, 3])
    with pytest.raises(TrajectoryError, match="prefix_len 3 but no parent_call_id"):
        CallTree.build(ExecutionCalls.from_arrow("e1", table))


def test_logprob_count_mismatch_is_refused() -> None:
    table = _table(parent_call_id=[None, None], prefix_len=[0, 0], output_logprobs=[[-0.1], []])
    with pytest.raises(TrajectoryError, match="has 0 output_logprobs for 1 output_ids"):
        ExecutionCalls.from_arrow("e1", table)


def test_unknown_branch_is_refused() -> None:
    table = _table(parent_call_id=[None, None], prefix_len=[0, 0], branch=["main", "helper"])
    with pytest.raises(TrajectoryError, match="branch 'helper'"):
        ExecutionCalls.from_arrow("e1", table)


def test_rows_scattered_over_batches_build_the_same_execution() -> None:
    table = _table(parent_call_id=[None, "a"], prefix_len=[0, 2])
    whole = ExecutionCalls.from_arrow("e1", table)
    batch = table.to_batches()[0]
    other = pa.RecordBatch.from_pylist([batch.to_pylist()[1], batch.to_pylist()[0]], schema=batch.schema)
    scattered = ExecutionCalls.from_fragments(
        "e1", [CallFragment.from_rows(other, np.array([1])), CallFragment.from_rows(other, np.array([0]))]
    )
    assert scattered.call_ids == whole.call_ids
    assert scattered.tokens.tolist() == whole.tokens.tolist()
    assert scattered.parent.tolist() == whole.parent.tolist()
