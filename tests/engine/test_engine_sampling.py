"""The log-prob rule and the sampler, against an independent re-implementation of the rule."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.engine.local.sampling import TokenFilter, draw, sampling_logprobs
from gyre.engine.protocol import SamplingParams


def reference(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """The documented rule, written out plainly in Python floats."""
    x = [v / temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = set(order if top_k == -1 else order[:top_k])

    def probs() -> dict[int, float]:
        m = max(x[i] for i in keep)
        z = sum(math.exp(x[i] - m) for i in keep)
        return {i: math.exp(x[i] - m) / z for i in keep}

    if top_p < 1.0:
        p, mass, nucleus = probs(), 0.0, set()
        for i in sorted(keep, key=lambda i: -p[i]):
            if mass >= top_p:
                break
            nucleus.add(i)
            mass += p[i]
        keep = nucleus
    if min_p > 0.0:
        p = probs()
        top = max(p.values())
        keep = {i for i in keep if p[i] >= min_p * top}
    p = probs()
    return [math.log(p[i]) if i in keep else -math.inf for i in range(len(x))]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    logits=st.lists(st.integers(-800, 800), min_size=2, max_size=40, unique=True).map(
        lambda xs: [x / 100 for x in xs]  # exact in float32 and tie-free, so both sides sort alike
    ),
    temperature=st.floats(0.05, 3.0),
    top_k=st.sampled_from([-1, 1, 2, 5]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
)
def test_rule_matches_reference(logits, temperature, top_k, top_p, min_p) -> None:
    f = TokenFilter(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = sampling_logprobs(torch.tensor(logits), f).tolist()
    want = reference(logits, temperature, top_k, top_p, min_p)
    for g, w in zip(got, want, strict=True):
        assert (g == w == -math.inf) or abs(g - w) < 1e-4


def test_unfiltered_rule_is_plain_log_softmax() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    f = TokenFilter.from_params(SamplingParams())
    assert torch.allclose(sampling_logprobs(logits, f), torch.log_softmax(logits, -1))


def test_greedy_is_a_point_mass_on_argmax() -> None:
    logits = torch.tensor([0.1, 2.0, 2.0, -1.0])
    f = TokenFilter.from_params(SamplingParams(temperature=0.0))
    lp = sampling_logprobs(logits, f)
    assert lp.tolist() == [-math.inf, 0.0, -math.inf, -math.inf]  # ties break like argmax: first index
    assert draw(lp, f, torch.Generator()) == 1


def test_draw_follows_distribution_and_never_picks_removed_tokens() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, -50.0])
    f = TokenFilter(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    lp = sampling_logprobs(logits, f)
    g = torch.Generator().manual_seed(0)
    counts = [0] * 5
    n = 4000
    for _ in range(n):
        counts[draw(lp, f, g)] += 1
    assert counts[0] == counts[4] == 0
    for i in (1, 2, 3):
        assert abs(counts[i] / n - math.exp(lp[i])) < 0.03


def test_draw_is_reproducible_for_a_seed() -> None:
    lp = torch.log_softmax(torch.randn(100, generator=torch.Generator().manual_seed(1)), -1)
    f = TokenFilter(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0)

    def run(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [draw(lp, f, g) for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize("bad", [{"top_k": 0}, {"top_p": 0.0}, {"temperature": -1}, {"stop": [""]}, {"n": 2}])
def test_invalid_sampling_params(bad) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)
