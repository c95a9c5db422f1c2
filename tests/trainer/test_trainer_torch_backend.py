"""The torch backend: tree-packed == expanded (loss and gradients), HF agreement, AdamW, accumulation,
checkpoints and named-tensor export."""

import pytest
import torch
from trainer_trees import OPEN_CLIP, micro_batches, random_group

from gyre.model import build_tiny_model
from gyre.trainer import (
    CheckpointError,
    GSPOConfig,
    OptimizerConfig,
    TorchBackend,
    TorchBackendConfig,
    TrainBatch,
    TrainerConfigError,
    TrainerError,
)


def backend(loss: GSPOConfig = OPEN_CLIP, dtype: str = "float64", **kwargs) -> TorchBackend:
    return TorchBackend(build_tiny_model(0), TorchBackendConfig(loss=loss, dtype=dtype, **kwargs))  # type: ignore[arg-type]


def gradients(b: TorchBackend) -> dict[str, torch.Tensor]:
    return {name: g.clone() for (name, _), g in zip(b.model.named_parameters(), b.gradient_buffers(), strict=True)}


def run_all(b: TorchBackend, batches: list[TrainBatch]) -> float:
    return sum(b.forward_backward(batch).stats.loss_sum for batch in batches)


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < tol, worst


@pytest.mark.parametrize("loss", [OPEN_CLIP, GSPOConfig()], ids=["open-clip", "paper-clip"])
def test_tree_packed_equals_expanded(packed_batches, expanded_batches, loss):
    """The core property: shared prefixes computed once change neither the loss nor any gradient."""
    packed, expanded = backend(loss), backend(loss)
    loss_packed, loss_expanded = run_all(packed, packed_batches), run_all(expanded, expanded_batches)
    assert loss_packed == pytest.approx(loss_expanded, abs=1e-5)
    grads = gradients(packed)
    assert max(float(g.abs().max()) for g in grads.values()) > 1e-3  # the comparison is not between zeros
    assert_close(grads, gradients(expanded), 1e-5)
    assert sum(b.tokens for b in packed_batches) < sum(b.tokens for b in expanded_batches)


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_tree_packed_equals_expanded_on_more_random_trees(seed):
    groups = [random_group(seed, executions=2, calls=16)]
    packed, expanded = backend(), backend()
    a = run_all(packed, [TrainBatch.from_micro_batch(m) for m in micro_batches(groups, "packed")])
    b = run_all(expanded, [TrainBatch.from_micro_batch(m) for m in micro_batches(groups, "expanded")])
    assert a == pytest.approx(b, abs=1e-5)
    assert_close(gradients(packed), gradients(expanded), 1e-5)


def test_sdpa_attention_takes_the_tree_mask_too(packed_batches, expanded_batches):
    packed, expanded = backend(attention="dense", attn_implementation="sdpa"), backend()
    assert run_all(packed, packed_batches) == pytest.approx(run_all(expanded, expanded_batches), abs=1e-5)
    assert_close(gradients(packed), gradients(expanded), 1e-5)


def test_splitting_into_more_passes_changes_nothing(packed_batches):
    whole, split = backend(), backend(max_forward_tokens=24, max_attention_area=24 * 24)
    results = [split.forward_backward(b) for b in packed_batches]
    assert sum(r.passes for r in results) > sum(whole.forward_backward(b).passes for b in packed_batches)
    assert_close(gradients(whole), gradients(split), 1e-6)  # the float32 softmax of HF eager sees other shapes


def test_expanded_log_probs_equal_a_plain_hf_forward(expanded_batches):
    b = backend()
    batch = expanded_batches[0]
    got = b.logprobs(batch)
    model = b.model.eval()
    want = torch.zeros_like(got)
    with torch.no_grad():
        for start, end in batch.blocks.tolist():
            logits = model(input_ids=batch.input_ids[start:end][None]).logits[0]
            lp = torch.log_softmax(logits, -1)
            inside = (batch.trained >= start) & (batch.trained < end)
            for i in torch.nonzero(inside).flatten().tolist():
                t = int(batch.trained[i])
                want[i] = lp[t - start - 1, batch.input_ids[t]]
    assert float((got - want).abs().max()) < 1e-6


def test_gradients_accumulate_across_micro_steps(packed_batches):
    first, second, both = backend(), backend(), backend()
    first.forward_backward(packed_batches[0])
    second.forward_backward(packed_batches[1])
    for batch in packed_batches[:2]:
        both.forward_backward(batch)
    summed = {k: v + gradients(second)[k] for k, v in gradients(first).items()}
    assert_close(gradients(both), summed, 1e-12)


def test_optimizer_step_normalises_clips_steps_and_bumps_the_version(packed_batches):
    b = backend(optimizer=OptimizerConfig(lr=1e-2, max_grad_norm=1e-3, weight_decay=0.0))
    for batch in packed_batches:
        b.forward_backward(batch)
    normalizer = sum(batch.weight for batch in packed_batches)
    expected_norm = float(torch.linalg.vector_norm(torch.stack([
        torch.linalg.vector_norm(g / normalizer) for g in b.gradient_buffers()
    ])))
    before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    result = b.optimizer_step(normalizer)
    assert result.policy_version == b.policy_version == 1
    assert result.grad_norm == pytest.approx(expected_norm, rel=1e-9)
    assert result.normalizer == normalizer
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in b.model.named_parameters())
    assert 0 < moved <= 1e-2 * 1.01  # Adam's first step moves each weight by at most about lr
    assert all(float(g.abs().max()) == 0 for g in b.gradient_buffers())  # zeroed for the next step


def test_bad_steps_are_refused(packed_batches):
    b = backend()
    with pytest.raises(TrainerError, match="normalizer"):
        b.optimizer_step(0.0)
    b.forward_backward(packed_batches[0])
    b.gradient_buffers()[0][0] = float("nan")
    before = b.policy_version
    with pytest.raises(TrainerError, match="not applied"):
        b.optimizer_step(1.0)
    assert b.policy_version == before


def test_checkpoint_round_trip_resumes_identically(tmp_path, packed_batches):
    config = {"optimizer": OptimizerConfig(lr=1e-2)}
    a = backend(**config)
    a.forward_backward(packed_batches[0])
    a.optimizer_step(1.0)
    a.save_checkpoint(tmp_path / "ckpt")
    b = backend(**config)
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.policy_version == 1
    for x in (a, b):  # a second step needs Adam's moments: equal only if they were restored
        x.forward_backward(packed_batches[1])
        x.optimizer_step(1.0)
    assert_close(dict(a.named_tensors()), dict(b.named_tensors()), 0.0 + 1e-15)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    from gyre.model import TinyModelConfig
    from gyre.model.tokenizer import VOCAB_SIZE

    backend().save_checkpoint(tmp_path / "ckpt")
    other = TorchBackend(build_tiny_model(0, TinyModelConfig(vocab_size=VOCAB_SIZE, hidden_size=64)))
    with pytest.raises(CheckpointError, match="another model"):
        other.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="lacks"):
        other.load_checkpoint(tmp_path / "missing")


def test_named_tensors_load_into_a_fresh_model_and_back(packed_batches):
    trained = backend(optimizer=OptimizerConfig(lr=1e-2))
    trained.forward_backward(packed_batches[0])
    trained.optimizer_step(1.0)
    exported = dict(trained.named_tensors())
    assert "lm_head.weight" not in exported  # tied to the embeddings: sent once
    fresh = backend()
    fresh.load_weights(exported, policy_version=trained.policy_version)
    assert fresh.policy_version == 1
    ids = torch.arange(20)[None]
    assert torch.equal(fresh.model(input_ids=ids).logits, trained.model(input_ids=ids).logits)
    with pytest.raises(TrainerError, match="missing"):
        fresh.load_weights({"model.norm.weight": exported["model.norm.weight"]})
    with pytest.raises(TrainerError, match="unknown"):
        fresh.load_weights({**exported, "nope": exported["model.norm.weight"]})


def test_dense_masks_need_an_attention_kernel_that_takes_them():
    model = build_tiny_model(0)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(TrainerConfigError, match="tree mask"):
        TorchBackend(model, TorchBackendConfig(attention="dense"))
    TorchBackend(model)  # the sparse tree attention replaces the model's kernel


def test_attention_options_are_checked():
    with pytest.raises(TrainerConfigError, match="attention='dense'"):
        TorchBackendConfig(attn_implementation="sdpa")
    with pytest.raises(TrainerConfigError, match="attention_chunk"):
        TorchBackendConfig(attention_chunk=0)
    with pytest.raises(TrainerConfigError, match="'tree' or 'dense'"):
        TorchBackendConfig(attention="flex")  # type: ignore[arg-type]
    with pytest.raises(TrainerConfigError, match="max_micro_batch_tokens"):
        TorchBackendConfig(max_micro_batch_tokens=0)


def test_a_micro_batch_over_the_token_limit_is_refused_before_it_runs(packed_batches):
    batch = packed_batches[0]
    b = backend(max_micro_batch_tokens=batch.tokens - 1)
    with pytest.raises(TrainerError, match="token_budget"):
        b.forward_backward(batch)
    assert all(g.abs().max() == 0 for g in b.gradient_buffers())


def test_float32_backend_agrees_with_float64(packed_batches):
    a, b = backend(dtype="float32"), backend(dtype="float64")
    assert run_all(a, packed_batches) == pytest.approx(run_all(b, packed_batches), abs=1e-4)
