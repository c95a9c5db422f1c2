"""The tiny model: Qwen2 architecture, about half a million parameters, deterministic for a seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gyre.model import TinyModelConfig, build_tiny_model, load_tiny, save_tiny
from gyre.model.tiny import EOS_TOKEN_ID, default_config


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_architecture_and_size() -> None:
    model = build_tiny_model(0)
    assert model.config.model_type == "qwen2"
    assert model.config._attn_implementation == "eager"
    assert 200_000 < sum(p.numel() for p in model.parameters()) < 2_000_000
    assert not model.training


def test_same_seed_same_weights_other_seed_differs() -> None:
    assert _same(build_tiny_model(3), build_tiny_model(3))
    assert not _same(build_tiny_model(3), build_tiny_model(4))


def test_building_does_not_disturb_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(0)
    assert torch.equal(torch.rand(3), expected)


def test_save_and_load_offline(tmp_path: Path) -> None:
    save_tiny(tmp_path, seed=5)
    model, tok = load_tiny(tmp_path)
    assert _same(model, build_tiny_model(5))
    ids = torch.tensor([tok.encode("hello", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, build_tiny_model(5)(ids).logits)
    assert model.config.eos_token_id == [EOS_TOKEN_ID, 256]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        TinyModelConfig(vocab_size=10, hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="vocab_size"):
        TinyModelConfig(vocab_size=0)
    assert default_config().to_hf().vocab_size == default_config().vocab_size
