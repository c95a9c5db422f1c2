"""Batch rows: packed trees against their expanded reference, weights, masks, budgets, torch views."""

from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from trajectory_helpers import ancestors_mask, branchy, call, calls, group, interval_mask, outcome, rows, trained

from gyre.trajectory import EXPANDED_COLUMNS, PACKED_COLUMNS, TrajectoryConfig, build, schema
from gyre.trajectory.batches import balanced, bins


def two_executions():
    simple = calls(
        call("a", delta=[100, 101], out=[102, 103], execution="e2"),
        call("b", parent="a", prefix=4, delta=[104], out=[105], execution="e2"),
    )
    return group([(outcome("e1", reward=1.0, n_calls=9), branchy().calls), (outcome("e2", reward=0.0), simple)])


@pytest.mark.parametrize("cap", [2, None])
def test_packed_and_expanded_train_the_same_tokens_with_the_same_weights(cap: int | None) -> None:
    packed, _ = build([two_executions()], TrajectoryConfig(cap=cap))
    expanded, _ = build([two_executions()], TrajectoryConfig(cap=cap, form="expanded"))
    packed_weights: dict[str, dict[int, float]] = defaultdict(dict)
    for row in rows(packed):
        packed_weights[row["execution_id"]] |= trained(row)
    expanded_weights: dict[str, dict[int, float]] = defaultdict(dict)
    for row in rows(expanded):
        mine = trained(row)
        assert not set(mine) & set(expanded_weights[row["execution_id"]]), "a token trained twice"
        expanded_weights[row["execution_id"]] |= mine
    assert packed_weights == expanded_weights
    for weights in packed_weights.values():
        assert sum(weights.values()) == pytest.approx(1.0)


def test_packed_row_is_the_union_of_expanded_rows_stored_once() -> None:
    packed, _ = build([two_executions()], TrajectoryConfig(cap=None))
    expanded, _ = build([two_executions()], TrajectoryConfig(cap=None, form="expanded"))
    for row in rows(packed):
        mine = [r for r in rows(expanded) if r["execution_id"] == row["execution_id"]]
        assert set(row["input_ids"]) == {t for r in mine for t in r["input_ids"]}
        assert len(row["trajectory_ends"]) == len(mine)
        for r in mine:  # walking parents up from a trajectory's end rebuilds its expanded row
            node, path = row["trajectory_ends"][r["trajectory_index"]], []
            while node >= 0:
                path.append(row["input_ids"][node])
                node = row["parent_ids"][node]
            assert path[::-1] == r["input_ids"]
            assert r["branch"] == row["trajectory_branches"][r["trajectory_index"]]


def test_tree_structure_of_a_packed_row() -> None:
    packed, _ = build([two_executions()], TrajectoryConfig(cap=None))
    for row in rows(packed):
        parents, positions = row["parent_ids"], row["position_ids"]
        for i, p in enumerate(parents):
            assert p < i
            assert positions[i] == (0 if p < 0 else positions[p] + 1)
        np.testing.assert_array_equal(ancestors_mask(parents), interval_mask(row["subtree_end"]))
        owners = row["trajectory_ids"]
        assert [o >= 0 for o in owners] == [bool(m) for m in row["loss_mask"]]


def test_context_tokens_are_never_trained_and_logprobs_travel_with_tokens() -> None:
    packed, _ = build([two_executions()], TrajectoryConfig(cap=None))
    tree_calls = branchy().calls
    policy = set(tree_calls.tokens[tree_calls.policy_mask()].tolist()) | {102, 103, 105}
    for row in rows(packed):
        for token, mask, logprob in zip(row["input_ids"], row["loss_mask"], row["behaviour_logprobs"], strict=True):
            assert not mask or token in policy
            if mask:
                assert logprob == pytest.approx(-token / 1000)
            elif token not in policy:
                assert logprob == 0.0


def test_advantages_rewards_and_ids_per_row() -> None:
    packed, report = build([two_executions()], TrajectoryConfig())
    by_id = {row["execution_id"]: row for row in rows(packed)}
    assert by_id["e1"]["reward"] == 1.0 and by_id["e2"]["reward"] == 0.0
    assert by_id["e1"]["advantages"] == pytest.approx([1.0] * len(by_id["e1"]["input_ids"]), abs=1e-5)
    assert by_id["e2"]["advantages"] == pytest.approx([-1.0] * len(by_id["e2"]["input_ids"]), abs=1e-5)
    assert {row["group_id"] for row in by_id.values()} == {"g1"}
    assert report.groups_used == 1 and report.executions_used == 2


def test_micro_batches_respect_the_token_budget() -> None:
    packed, report = build([two_executions()], TrajectoryConfig(cap=None, form="expanded", token_budget=12))
    assert all(batch.tokens <= 12 for batch in packed)
    assert sum(batch.rows for batch in packed) == report.trajectories_kept
    assert [b.index for b in packed] == list(range(len(packed)))
    oversized, report = build([two_executions()], TrajectoryConfig(cap=None, token_budget=4))
    assert report.oversized_rows == len(oversized) == 2 and all(b.rows == 1 for b in oversized)


def test_first_fit_decreasing_bins() -> None:
    assert bins([5, 3, 4, 2, 9], budget=8) == [[4], [0, 1], [2, 3]]
    assert bins([], budget=8) == []


def test_a_fixed_cut_gives_exactly_that_many_balanced_bins() -> None:
    """`micro_steps_per_group`: the plan is known before the group's rows are (empty bins when fewer rows)."""
    assert balanced([5, 3, 4, 2, 9], 2) == [[1, 4], [0, 2, 3]]  # 12 and 11 tokens: longest first, lightest bin
    assert balanced([7, 1], 4) == [[0], [1], [], []]
    assert balanced([], 3) == [[], [], []]


@pytest.mark.parametrize(("form", "spec"), [("packed", PACKED_COLUMNS), ("expanded", EXPANDED_COLUMNS)])
def test_batches_follow_the_spec(form: str, spec: tuple) -> None:
    batches, _ = build([two_executions()], TrajectoryConfig(form=form))  # type: ignore[arg-type]
    for batch in batches:
        assert batch.batch.schema.equals(schema(form))  # type: ignore[arg-type]
        assert [f.name for f in batch.batch.schema] == [c.name for c in spec]
        assert all(batch.batch.column(c.name).null_count == 0 for c in spec)


def test_to_torch_shares_the_arrow_buffers() -> None:
    (batch,) = build([two_executions()], TrajectoryConfig(cap=None))[0]
    tensors = batch.to_torch()
    ids = batch.batch.column("input_ids")
    assert tensors["input_ids"].data_ptr() == ids.values.buffers()[1].address
    assert tensors["cu_seqlens"].tolist() == ids.offsets.to_pylist()
    assert tensors["loss_mask"].dtype == torch.bool
    assert tensors["token_weights"].sum().item() == pytest.approx(2.0)  # two executions, one each
    assert tensors["input_ids"].shape == tensors["parent_ids"].shape == (batch.tokens,)
    assert tensors["execution_id"] == ["e1", "e2"]
    assert tensors["trajectory_ends_offsets"].tolist()[-1] == len(tensors["trajectory_ends"])


def test_a_micro_batch_survives_arrow_ipc() -> None:
    (batch,) = build([two_executions()], TrajectoryConfig())[0]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.batch.schema) as writer:
        writer.write_batch(batch.batch)
    back = pa.ipc.open_stream(sink.getvalue()).read_next_batch()
    assert back.equals(batch.batch)


def test_the_docs_list_every_column() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "trajectory.md").read_text()
    for column in {*PACKED_COLUMNS, *EXPANDED_COLUMNS}:
        assert f"| `{column.name}` |" in docs, f"docs/trajectory.md does not describe column {column.name!r}"
