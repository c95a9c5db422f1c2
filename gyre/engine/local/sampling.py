"""Next-token distributions, sampling and the log-prob rule.

The rule (docs/engine.md): the returned log-prob of a token is its log-probability under the distribution
it was actually drawn from,

    logits / temperature  ->  keep top_k  ->  keep the smallest top-p nucleus  ->  drop p < min_p * p_max
    ->  renormalise (log_softmax over the kept tokens).

With temperature 1 and no truncation that is exactly `log_softmax(logits)`. Greedy decoding
(temperature < 1e-6) is, as in SGLang, temperature 1 with top_k = 1: a point mass, so its log-prob is 0.
Each filter is applied to the distribution left by the previous one, in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyre.engine.protocol import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenFilter:
    """The distribution-shaping part of `SamplingParams`, normalised (greedy folded into top_k = 1)."""

    temperature: float
    top_k: int  # -1 = off
    top_p: float
    min_p: float

    @classmethod
    def from_params(cls, p: SamplingParams) -> TokenFilter:
        if p.is_greedy:
            return cls(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0)
        return cls(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1


def sampling_logprobs(logits: torch.Tensor, f: TokenFilter) -> torch.Tensor:
    """Log-probabilities (float32, `-inf` for removed tokens) of the distribution sampled from.

    `logits` is `[vocab]` or `[n, vocab]`; one filter applies to every row.
    """
    x = logits.float() / f.temperature
    vocab = x.shape[-1]
    if f.top_k == 1:  # argmax, so greedy ties break exactly as in a plain `argmax` loop
        kth = torch.argmax(x, dim=-1, keepdim=True)
        x = x.masked_fill(~torch.zeros_like(x, dtype=torch.bool).scatter_(-1, kth, True), float("-inf"))
    elif f.top_k != -1 and f.top_k < vocab:
        kth = torch.topk(x, f.top_k, dim=-1).indices
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, kth, True)
        x = x.masked_fill(~keep, float("-inf"))
    if f.top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly ahead of each token
        drop_sorted = before >= f.top_p  # the smallest prefix whose mass reaches top_p survives
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if f.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * f.min_p
        x = x.masked_fill(probs < threshold, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def draw(logprobs: torch.Tensor, f: TokenFilter, generator: torch.Generator) -> int:
    """Draw one token id from a `[vocab]` row of `sampling_logprobs` (inverse CDF of one uniform).

    One uniform per token from the request's own generator makes a seeded request reproducible
    whatever else is in the batch.
    """
    if f.is_greedy:
        return int(torch.argmax(logprobs).item())
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    cdf = torch.cumsum(logprobs.double().exp(), dim=-1)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * cdf[-1].item()], dtype=torch.float64), right=True))
    idx = min(idx, logprobs.shape[-1] - 1)
    while logprobs[idx] == float("-inf"):  # only reachable through float rounding at the top of the CDF
        idx -= 1
    return idx
