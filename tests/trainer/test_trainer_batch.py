"""TrainBatch and forward passes: both batch forms give the same units and tokens; the tree mask is the
ancestor relation; grouping covers every block once within its limits."""

from collections import defaultdict

import pytest
import torch
from trainer_trees import micro_batches, random_group

from gyre.trainer import BatchFormatError, TrainBatch
from gyre.trainer.passes import MIN_FILL, group_blocks, plan


def unit_tokens(batches: list[TrainBatch]) -> dict[tuple[str, int], list[tuple[int, int, float, float]]]:
    """(execution, rank) -> sorted (position, token, weight, behaviour log-prob) of the tokens it trains."""
    out: dict[tuple[str, int], list] = defaultdict(list)
    for b in batches:
        for i, unit in enumerate(b.unit_ids.tolist()):
            t = int(b.trained[i])
            out[b.units[unit]].append(
                (int(b.position_ids[t]), int(b.input_ids[t]), float(b.token_weights[i]), float(b.behaviour_logprobs[i]))
            )
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("seed", range(4))
def test_packed_and_expanded_train_the_same_units(seed):
    groups = [random_group(seed, executions=3, calls=12)]
    packed = [TrainBatch.from_micro_batch(m) for m in micro_batches(groups, "packed")]
    expanded = [TrainBatch.from_micro_batch(m) for m in micro_batches(groups, "expanded")]
    assert unit_tokens(packed) == unit_tokens(expanded)
    assert sum(b.tokens for b in packed) <= sum(b.tokens for b in expanded)
    assert sum(b.weight for b in packed) == pytest.approx(3.0)  # every execution weighs total_weight = 1


def ancestors(parent: list[int], i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = parent[i]
    return out


@pytest.mark.parametrize("form", ["packed", "expanded"])
def test_the_pass_mask_is_the_ancestor_relation_and_parents_predict(form):
    batch = TrainBatch.from_micro_batch(micro_batches([random_group(11, executions=2, calls=14)], form)[0])
    parent = batch.parent.tolist()
    seen = 0
    for group in plan(batch, max_tokens=64, max_area=64 * 64):
        for slot, block in enumerate(group.blocks):
            start, end = batch.blocks[block].tolist()
            n = end - start
            for i in range(group.length):
                allowed = set(torch.nonzero(group.allowed[slot, i]).flatten().tolist())
                if i < n:
                    assert allowed == {a - start for a in ancestors(parent, start + i)}
                else:
                    assert allowed == {i}  # padding sees itself only
            assert group.input_ids[slot, :n].tolist() == batch.input_ids[start:end].tolist()
        seen += len(group.blocks)
        trained = batch.trained[group.trained]
        slots = group.parent_slots
        for t, s in zip(trained.tolist(), slots.tolist(), strict=True):
            slot, offset = divmod(s, group.length)
            assert batch.blocks[group.blocks[slot], 0] + offset == parent[t]
    assert seen == batch.blocks.shape[0]


def test_blocks_tile_the_batch_and_a_unit_stays_in_one_block():
    batch = TrainBatch.from_micro_batch(micro_batches([random_group(5, executions=3, calls=15)], "packed")[0])
    starts, ends = batch.blocks[:, 0].contiguous(), batch.blocks[:, 1].contiguous()
    assert int(starts[0]) == 0 and int(ends[-1]) == batch.tokens and bool((starts[1:] == ends[:-1]).all())
    block_of = torch.searchsorted(ends, batch.trained, right=True)
    for unit in range(batch.num_units):
        assert len(set(block_of[batch.unit_ids == unit].tolist())) == 1


@pytest.mark.parametrize("seed", range(5))
def test_grouping_covers_every_block_once_within_limits(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 300, (40,), generator=g).tolist()
    groups = group_blocks(lengths, max_tokens=1024, max_area=1024 * 200)
    assert sorted(i for grp in groups for i in grp) == list(range(40))
    for grp in groups:
        longest = max(lengths[i] for i in grp)
        if len(grp) > 1:
            assert len(grp) * longest <= 1024 and len(grp) * longest * longest <= 1024 * 200
            assert sum(lengths[i] for i in grp) >= MIN_FILL * len(grp) * longest


def test_a_trained_token_without_a_predecessor_is_rejected():
    mb = micro_batches([random_group(2, executions=2)], "expanded")[0]
    columns = mb.to_torch()
    columns["loss_mask"] = columns["loss_mask"].clone()
    columns["loss_mask"][0] = True
    with pytest.raises(BatchFormatError, match="starts its sequence"):
        TrainBatch.from_columns("expanded", columns)


def test_a_broken_tree_is_rejected():
    mb = micro_batches([random_group(2, executions=2)], "packed")[0]
    columns = mb.to_torch()
    columns["subtree_end"] = columns["subtree_end"].clone()
    columns["subtree_end"][0] = 1  # the first root claims a one-token subtree: roots no longer tile the row
    with pytest.raises(BatchFormatError):
        TrainBatch.from_columns("packed", columns)


def test_missing_columns_are_named():
    columns = micro_batches([random_group(2, executions=2)], "packed")[0].to_torch()
    del columns["trajectory_ids"]
    with pytest.raises(BatchFormatError, match="trajectory_ids"):
        TrainBatch.from_columns("packed", columns)
