"""Shared fixtures of the trainer tests: the tiny model in float64 and random tree batches."""

import pytest
from trainer_trees import micro_batches, random_group

from gyre.trainer import TrainBatch


@pytest.fixture(scope="session")
def tree_groups():
    return [random_group(seed, executions=3, calls=12, group_id=f"g{seed}") for seed in range(2)]


@pytest.fixture(scope="session")
def packed_batches(tree_groups):
    return [TrainBatch.from_micro_batch(m) for m in micro_batches(tree_groups, "packed")]


@pytest.fixture(scope="session")
def expanded_batches(tree_groups):
    return [TrainBatch.from_micro_batch(m) for m in micro_batches(tree_groups, "expanded")]
