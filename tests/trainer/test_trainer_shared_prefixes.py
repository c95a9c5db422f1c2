"""Group-shared prefixes and sparse tree attention: the same loss and gradients as the expanded form.

A packed micro-batch forwards a group's common task prompt once (``gyre.trajectory.share``) and attends
with ``TreeMask`` (no ``L x L`` mask); neither may change a loss or a gradient (float64, 1e-5), and policy
tokens of different executions are never merged.
"""

import numpy as np
import pytest
import torch
from trainer_trees import OPEN_CLIP, micro_batches, random_group

from gyre.events import ModelCallFinished
from gyre.model import build_tiny_model
from gyre.trainer import TorchBackend, TorchBackendConfig, TrainBatch
from gyre.trainer.passes import plan_tree
from gyre.trainer.tree_attention import TreeMask
from gyre.trajectory import BatchBuilder, ExecutionCalls, ExecutionOutcome, Group, Member, TrajectoryConfig

PROMPT = 40


def backend(**kwargs) -> TorchBackend:
    return TorchBackend(build_tiny_model(0), TorchBackendConfig(loss=OPEN_CLIP, dtype="float64", **kwargs))


def run(b: TorchBackend, batches: list[TrainBatch]) -> tuple[float, dict[str, torch.Tensor]]:
    loss = sum(b.forward_backward(batch).stats.loss_sum for batch in batches)
    return loss, {n: g.clone() for (n, _), g in zip(b.model.named_parameters(), b.gradient_buffers(), strict=True)}


def assert_same(a: tuple[float, dict], b: tuple[float, dict]) -> None:
    assert a[0] == pytest.approx(b[0], abs=1e-5)
    assert max(float(g.abs().max()) for g in a[1].values()) > 1e-3  # not a comparison of zeros
    assert max(float((a[1][k] - b[1][k]).abs().max()) for k in a[1]) < 1e-5


@pytest.fixture(scope="module")
def prompt_groups():
    return [random_group(seed, executions=4, calls=10, group_id=f"g{seed}", prompt_tokens=PROMPT) for seed in (5, 6)]


def test_a_groups_prompt_is_forwarded_once(prompt_groups):
    for mb in micro_batches(prompt_groups, "packed"):
        shared, rows = TrainBatch.from_micro_batch(mb), TrainBatch.from_micro_batch(mb, share=False)
        assert shared.row_tokens == rows.tokens
        assert shared.tokens <= rows.tokens - (mb.rows - 1) * PROMPT  # every extra row saves its prompt at least
        assert shared.trained_tokens == rows.trained_tokens
        assert torch.equal(shared.input_ids[shared.trained].sort().values, rows.input_ids[rows.trained].sort().values)


@pytest.mark.parametrize("attention", ["tree", "dense"])
def test_shared_packed_equals_expanded(prompt_groups, attention):
    shared = [TrainBatch.from_micro_batch(m) for m in micro_batches(prompt_groups, "packed")]
    expanded = [TrainBatch.from_micro_batch(m) for m in micro_batches(prompt_groups, "expanded")]
    assert sum(b.tokens for b in shared) < sum(b.row_tokens for b in shared)
    assert_same(run(backend(attention=attention), shared), run(backend(), expanded))


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_tree_attention_equals_the_dense_mask(prompt_groups, chunk):
    """Small chunks exercise gathered (non-contiguous) ancestor keys; gradients equal the dense form's."""
    batches = [TrainBatch.from_micro_batch(m) for m in micro_batches(prompt_groups, "packed")]
    dense = run(backend(attention="dense"), batches)
    tree = run(backend(attention_chunk=chunk), batches)
    assert_same(tree, dense)


def twin(execution_id: str, prompt: list[int], output: list[int], logprob: float) -> Member:
    calls = [
        ModelCallFinished(execution_id=execution_id, call_id=f"{execution_id}/c0", cell_id="cell-0", branch="main",
                          prefix_len=0, prompt_delta_ids=prompt, output_ids=output,
                          output_logprobs=[logprob] * len(output), policy_version=0),
        ModelCallFinished(execution_id=execution_id, call_id=f"{execution_id}/c1", cell_id="cell-0", branch="main",
                          parent_call_id=f"{execution_id}/c0", prefix_len=len(prompt) + len(output),
                          prompt_delta_ids=[7, 8, 9], output_ids=output, output_logprobs=[logprob + 0.5] * len(output),
                          policy_version=0),
    ]
    reward = 1.0 if execution_id.endswith("a") else 0.0
    outcome = ExecutionOutcome(execution_id=execution_id, group_id="twins", task_id="t", status="completed",
                               reward=reward, calls=2)
    return Member(outcome, ExecutionCalls.from_events(calls))


def test_identical_policy_tokens_of_two_executions_are_never_merged():
    """Two executions that sampled the very same tokens share only the prompt; each keeps its own units.

    (Their behaviour log-probs differ, as two samples' would, so the two units' gradients do not cancel.)"""
    prompt, output = list(range(10, 30)), [40, 41, 42, 43]
    group = Group("twins", (twin("e-a", prompt, output, -5.5), twin("e-b", prompt, output, -4.0)))
    (mb,) = micro_batches([group], "packed")
    shared, rows = TrainBatch.from_micro_batch(mb), TrainBatch.from_micro_batch(mb, share=False)
    per_execution = len(prompt) + 2 * len(output) + 3
    assert rows.tokens == 2 * per_execution
    assert shared.tokens == 2 * per_execution - len(prompt)  # the prompt once; outputs and what follows twice
    assert shared.trained_tokens == rows.trained_tokens == 2 * (2 * len(output))
    assert len(set(shared.trained.tolist())) == shared.trained_tokens
    assert shared.units == rows.units and shared.num_units == 2
    # each execution's ratio and gradient are its own: shared == unshared, unit by unit
    b = backend()
    got, want = b.logprobs(shared), b.logprobs(rows)
    for u in range(shared.num_units):
        assert got[shared.unit_ids == u].sort().values.tolist() == pytest.approx(
            want[rows.unit_ids == u].sort().values.tolist(), abs=1e-10)
    assert_same(run(backend(), [shared]), run(backend(), [rows]))


def test_the_tree_mask_grows_with_tokens_not_their_square():
    """A 1M-token tree (a 49K prompt shared by 16 long branches) is held in a few MB: subtree ends plus key
    ranges, never an L x L mask; its scored pairs are those of the chunks, far below L^2."""
    prompt, branch, chunk = 49_152, 59_490, 256
    n = prompt + 16 * branch
    parent = torch.arange(-1, n - 1)
    ends = torch.full((n,), n)
    for k in range(16):
        s = prompt + k * branch
        parent[s] = prompt - 1
        ends[s : s + branch] = s + branch
    mask = TreeMask.build(parent, ends, torch.tensor([[0, n]]), chunk)
    assert n >= 1_000_000
    assert mask.nbytes < 16 * n  # linear: 8 bytes of subtree end per token plus a few ranges per chunk
    assert mask.scored_pairs < n * n / 8


def test_the_token_budget_counts_a_shared_prompt_once():
    """Rows that share their prompt fit a budget their plain sum exceeds; the trainer forwards within it."""
    group = random_group(9, executions=4, calls=4, prompt_tokens=200)
    rows = [TrainBatch.from_micro_batch(m, share=False).tokens for m in micro_batches([group], "packed")]
    budget = sum(rows) - 3 * 200 + 10
    (shared,) = micro_batches([group], "packed", token_budget=budget)
    assert shared.tokens > budget >= shared.forward_bound >= TrainBatch.from_micro_batch(shared).tokens
    plain = BatchBuilder(TrajectoryConfig(cap=5, token_budget=budget, share_prefixes=False))
    assert len(list(plain.batches([group]))) > 1


def test_flat_passes_split_at_blocks_within_the_token_limit(prompt_groups):
    batch = TrainBatch.from_micro_batch(micro_batches(prompt_groups, "packed")[0], share=False)
    passes = plan_tree(batch, max_tokens=int((batch.blocks[:, 1] - batch.blocks[:, 0]).max()), chunk=16)
    assert len(passes) > 1
    assert sum(p.padded_tokens for p in passes) == batch.tokens  # flat: no padding at all
    assert np.array_equal(np.concatenate([p.trained.numpy() for p in passes]), np.arange(batch.trained_tokens))
