"""One conformance suite for the TrainerBackend protocol, run against every backend (each supplies a factory)."""

import importlib.util

import pytest
import torch

from gyre.model import build_tiny_model
from gyre.trainer import BackendUnavailableError, TorchBackend, TorchBackendConfig, TrainerBackend

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None
pytestmark = [  # megatron-core warns about missing Transformer Engine / Apex and future tp_group arguments
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module")
def megatron_runtime():
    if not HAVE_MEGATRON:
        pytest.skip("megatron-core is not installed (pip install megatron-core==0.16.1)")
    from gyre.trainer.megatron import MegatronRuntime

    with MegatronRuntime("cpu") as runtime:
        yield runtime


@pytest.fixture(params=["torch", "megatron"])
def make(request):
    """A factory of fresh backends holding the tiny model (seed 0) in float64."""
    if request.param == "torch":
        return lambda: TorchBackend(build_tiny_model(0), TorchBackendConfig(dtype="float64"))
    runtime = request.getfixturevalue("megatron_runtime")
    from gyre.trainer.megatron import MegatronBackend, MegatronBackendConfig

    return lambda: MegatronBackend.from_hf_model(
        build_tiny_model(0), MegatronBackendConfig(dtype="float64"), runtime=runtime
    )


def test_it_is_a_trainer_backend_with_hf_names(make):
    backend = make()
    assert isinstance(backend, TrainerBackend)
    hf = dict(build_tiny_model(0).named_parameters())
    exported = dict(backend.named_tensors())
    assert exported.keys() == hf.keys()
    assert all(torch.equal(exported[n], hf[n].detach().double()) for n in hf)


def test_load_weights_replaces_every_parameter_and_sets_the_version(make):
    backend = make()
    other = {n: p.detach().double() for n, p in build_tiny_model(7).named_parameters()}
    backend.load_weights(other, policy_version=5)
    assert backend.policy_version == 5
    exported = dict(backend.named_tensors())
    assert all(torch.equal(exported[n], other[n]) for n in other)


def test_forward_backward_accumulates_until_zero_grad(make, packed_batches):
    backend = make()
    first = backend.forward_backward(packed_batches[0])
    once = [g.clone() for g in backend.gradient_buffers()]
    second = backend.forward_backward(packed_batches[0])
    assert second.stats.loss_sum == pytest.approx(first.stats.loss_sum, abs=1e-9)
    assert all(torch.allclose(g, 2 * o, atol=1e-12) for g, o in zip(backend.gradient_buffers(), once, strict=True))
    assert first.tokens == packed_batches[0].tokens and first.passes >= 1
    backend.zero_grad()
    assert all(float(g.abs().max()) == 0 for g in backend.gradient_buffers())


def test_optimizer_step_steps_or_says_why_not(make, packed_batches):
    backend = make()
    backend.forward_backward(packed_batches[0])
    before = {n: t.clone() for n, t in backend.named_tensors()}
    try:
        result = backend.optimizer_step(packed_batches[0].weight)
    except BackendUnavailableError:  # Megatron on CPU: its optimizer needs CUDA, and it does not pretend
        assert backend.policy_version == 0
        assert all(torch.equal(t, before[n]) for n, t in backend.named_tensors())
        return
    assert result.policy_version == backend.policy_version == 1
    assert any(not torch.equal(t, before[n]) for n, t in backend.named_tensors())


def test_checkpoint_round_trip(make, tmp_path):
    source = make()
    source.load_weights({n: p.detach().double() for n, p in build_tiny_model(3).named_parameters()}, policy_version=2)
    source.save_checkpoint(tmp_path / "ckpt")
    target = make()
    target.load_checkpoint(tmp_path / "ckpt")
    assert target.policy_version == 2
    a, b = dict(source.named_tensors()), dict(target.named_tensors())
    assert all(torch.equal(a[n], b[n]) for n in a)
