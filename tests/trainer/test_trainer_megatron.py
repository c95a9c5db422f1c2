"""The Megatron backend on CPU: the real model path against the torch backend, the name mapping, and the
clear errors of its CUDA-only parts. Needs megatron-core (``pip install megatron-core==0.16.1``)."""

import pytest
import torch
from trainer_trees import OPEN_CLIP

from gyre.model import TinyModelConfig, build_tiny_model
from gyre.model.tokenizer import VOCAB_SIZE
from gyre.trainer import BackendUnavailableError, GSPOConfig, TorchBackend, TorchBackendConfig, TrainerConfigError
from gyre.trainer.megatron import MegatronBackendConfig, Shape, to_hf, to_megatron

megatron = pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)"
)
pytestmark = [  # megatron-core warns about missing Transformer Engine / Apex and future tp_group arguments
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

GQA = TinyModelConfig(vocab_size=VOCAB_SIZE, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                      intermediate_size=160, tie_word_embeddings=False)
"""Three query heads per group and an untied head: the layouts the mapping must get right."""


@pytest.fixture(scope="module")
def runtime():
    from gyre.trainer.megatron import MegatronRuntime

    with MegatronRuntime("cpu") as rt:
        yield rt


def test_weight_mapping_round_trips_with_grouped_query_attention():
    model = build_tiny_model(1, GQA)
    hf = {n: p.detach() for n, p in model.named_parameters()}
    shape = Shape.from_hf(model.config)
    mg = to_megatron(hf, shape)
    assert mg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (96 + 2 * 2 * 16, 96)
    back = to_hf(mg, shape)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_mapping_errors_name_the_tensor():
    model = build_tiny_model(0)
    hf = {n: p.detach() for n, p in model.named_parameters() if n != "model.norm.weight"}
    with pytest.raises(TrainerConfigError, match=r"model\.norm\.weight"):
        to_megatron(hf, Shape.from_hf(model.config))


@pytest.mark.parametrize("model_config", [None, GQA], ids=["tiny", "gqa-untied"])
@pytest.mark.parametrize("loss", [OPEN_CLIP, GSPOConfig()], ids=["open-clip", "paper-clip"])
def test_same_loss_and_gradients_as_the_torch_backend(runtime, packed_batches, model_config, loss):
    from gyre.trainer.megatron import MegatronBackend

    hf = build_tiny_model(0, model_config)
    reference = TorchBackend(hf, TorchBackendConfig(dtype="float64", loss=loss))
    backend = MegatronBackend.from_hf_model(
        reference.model, MegatronBackendConfig(dtype="float64", loss=loss), runtime=runtime
    )
    for batch in packed_batches:
        want = reference.forward_backward(batch).stats
        got = backend.forward_backward(batch).stats
        assert got.loss_sum == pytest.approx(want.loss_sum, abs=1e-6)
        assert got.clipped_weight == pytest.approx(want.clipped_weight)
    grads = backend.named_gradients()
    torch_grads = {n: p.grad for n, p in reference.model.named_parameters()}
    assert grads.keys() == torch_grads.keys()
    assert max(float((grads[n] - torch_grads[n]).abs().max()) for n in grads) < 1e-5
    exported = dict(backend.named_tensors())
    assert all(torch.equal(exported[n], p.detach()) for n, p in reference.model.named_parameters())


def test_cpu_optimizer_step_is_a_clear_error_not_a_fake_step(runtime, packed_batches):
    from gyre.trainer.megatron import MegatronBackend

    backend = MegatronBackend.from_hf_model(build_tiny_model(0), runtime=runtime)
    backend.forward_backward(packed_batches[0])
    with pytest.raises(BackendUnavailableError, match="needs CUDA"):
        backend.optimizer_step(1.0)
    assert backend.policy_version == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised on machines without CUDA")
def test_cuda_backend_without_cuda_is_a_clear_error(runtime):
    from gyre.trainer.megatron import MegatronBackend

    with pytest.raises(BackendUnavailableError, match="needs CUDA"):
        MegatronBackend(build_tiny_model(0).config, MegatronBackendConfig(device="cuda"), runtime=runtime)


def test_checkpoint_keeps_hf_names_and_version(runtime, tmp_path, packed_batches):
    from gyre.trainer.megatron import MegatronBackend

    source = MegatronBackend.from_hf_model(build_tiny_model(3), runtime=runtime)
    source.policy_version = 4
    source.save_checkpoint(tmp_path / "ckpt")
    loaded = MegatronBackend(build_tiny_model(0).config, runtime=runtime)
    loaded.load_checkpoint(tmp_path / "ckpt")
    assert loaded.policy_version == 4
    a, b = dict(source.named_tensors()), dict(loaded.named_tensors())
    assert all(torch.equal(a[n], b[n]) for n in a)
    from safetensors.torch import load_file

    torch_side = TorchBackend(build_tiny_model(0))  # the same file loads into the torch backend as it is
    torch_side.load_weights(load_file(str(tmp_path / "ckpt" / "model.safetensors")))
    assert all(torch.equal(p.detach(), a[n]) for n, p in torch_side.model.named_parameters())
