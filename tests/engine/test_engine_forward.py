"""The ragged batched forward reproduces the HF Qwen2 forward, however the tokens are chunked."""

from __future__ import annotations

import torch

from gyre.engine.local.forward import RaggedQwen2, StepInput
from gyre.engine.local.kv import SequenceKV
from gyre.model import build_tiny_model


def test_chunked_batched_forward_matches_hf() -> None:
    model = build_tiny_model(0)
    runner = RaggedQwen2(model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 265, (n,), generator=g).tolist() for n in (37, 5, 60)]
    with torch.no_grad():
        ref = [model(torch.tensor([s])).logits[0] for s in seqs]
    kvs = [SequenceKV(runner.kv_shape, 2) for _ in seqs]  # tiny capacity: exercises growth
    first = runner.step([StepInput(kv, s[:3], True) for kv, s in zip(kvs, seqs, strict=True)])
    for out, r in zip(first, ref, strict=True):
        assert out is not None and torch.allclose(out, r[2], atol=1e-4)
    # second step mixes a one-token decode-like input with long chunks, and skips one logits row
    rest = [
        StepInput(kvs[0], seqs[0][3:], True),
        StepInput(kvs[1], seqs[1][3:4], False),
        StepInput(kvs[2], seqs[2][3:], True),
    ]
    second = runner.step(rest)
    assert second[1] is None
    assert torch.allclose(second[0], ref[0][-1], atol=1e-4)
    assert torch.allclose(second[2], ref[2][-1], atol=1e-4)
    assert [kv.length for kv in kvs] == [37, 4, 60]
