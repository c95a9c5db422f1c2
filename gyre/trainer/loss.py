"""The GSPO loss: a pure function of per-token log-probs and batch columns (torch only, no model, no I/O).

For one **unit** ``i`` (the policy tokens one kept trajectory trains, see ``docs/trainer.md``) with advantage
``A_i``::

    s_i  = exp(mean_{t in i} (log pi_theta(t) - log pi_behaviour(t)))        sequence ratio, length-normalised
    s~_i = s_i * sg(min(1, C / s_i))                                           truncated IS (value min(s_i, C))
    J_i  = min(s~_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)
    loss = - sum_t w_t * J_{unit(t)}                                           w_t: the batch's token weights

``sg`` is stop-gradient: a truncated sequence keeps the direction of its gradient with its weight capped at
``C``, as truncated importance sampling does. The sum is returned un-normalised so that forward passes,
micro-batches and replicas add up exactly; the step divides by its total token weight (every execution
weighs ``total_weight``), which makes the loss a mean over executions of a token-weighted mean within each.

Invariants (tested against a float64 reference): every trained token belongs to exactly one unit; a unit's
ratio depends on its own tokens only; the gradient of an unclipped unit is ``-W_i A_i s~_i`` times the mean
of its tokens' score functions, ``W_i`` being the unit's total token weight.
"""

import operator
from dataclasses import dataclass, fields

import torch

from gyre.trainer.config import GSPOConfig


@dataclass(frozen=True)
class LossStats:
    """Sums over the tokens a loss call saw; add two to merge passes, micro-steps or replicas."""

    loss_sum: float = 0.0
    weight: float = 0.0
    """Sum of the token weights (the normaliser's share of these tokens)."""
    tokens: int = 0
    units: int = 0
    clipped_weight: float = 0.0
    """Token weight in units whose clipped branch is active (they contribute no gradient)."""
    truncated_weight: float = 0.0
    """Token weight in units whose importance weight the TIS cap truncated."""
    log_ratio_sum: float = 0.0
    """Sum over units of the mean log-ratio ``log s_i`` (unclamped)."""
    abs_token_log_ratio_sum: float = 0.0
    """Sum over tokens of ``|log pi_theta - log pi_behaviour|``: the engine/trainer (and staleness) mismatch."""
    max_abs_token_log_ratio: float = 0.0
    """Largest ``|log pi_theta - log pi_behaviour|`` of one token (merged by max, not summed)."""
    kl_sum: float = 0.0
    """Sum over tokens of the k3 estimator ``r - 1 - log r`` (``r = pi_theta / pi_behaviour``, tokens sampled
    from the behaviour policy): its mean estimates KL(behaviour || theta) without bias and is never negative."""
    neg_logprob_sum: float = 0.0
    """Sum over tokens of ``-log pi_theta``: its mean estimates the policy's entropy (the tokens were sampled
    from the behaviour policy, which is the trainer's up to the mismatch above)."""

    def __add__(self, other: "LossStats") -> "LossStats":
        return LossStats(
            *(_MERGE.get(f.name, operator.add)(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))
        )

    @property
    def loss(self) -> float:
        """Token-weighted mean loss of these tokens (0 when they weigh nothing)."""
        return self.loss_sum / self.weight if self.weight else 0.0

    @property
    def clip_fraction(self) -> float:
        return self.clipped_weight / self.weight if self.weight else 0.0

    @property
    def truncated_fraction(self) -> float:
        return self.truncated_weight / self.weight if self.weight else 0.0

    @property
    def mean_log_ratio(self) -> float:
        return self.log_ratio_sum / self.units if self.units else 0.0

    @property
    def mean_abs_token_log_ratio(self) -> float:
        return self.abs_token_log_ratio_sum / self.tokens if self.tokens else 0.0

    @property
    def kl(self) -> float:
        return self.kl_sum / self.tokens if self.tokens else 0.0

    @property
    def entropy(self) -> float:
        return self.neg_logprob_sum / self.tokens if self.tokens else 0.0


_MERGE = {"max_abs_token_log_ratio": max}
"""Fields that do not add up when stats merge (every other field is a sum)."""


def sequence_log_ratios(log_ratio: torch.Tensor, unit_ids: torch.Tensor, num_units: int) -> torch.Tensor:
    """Mean of ``log_ratio`` over each unit's tokens: ``log s_i`` (differentiable, one value per unit)."""
    sums = torch.zeros(num_units, dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, unit_ids, log_ratio)
    counts = torch.zeros(num_units, dtype=log_ratio.dtype, device=log_ratio.device).index_add(
        0, unit_ids, torch.ones_like(log_ratio)
    )
    return sums / counts.clamp_min(1)


def gspo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    token_weights: torch.Tensor,
    unit_ids: torch.Tensor,
    num_units: int,
    config: GSPOConfig,
) -> tuple[torch.Tensor, LossStats]:
    """Un-normalised GSPO loss ``-sum_t w_t J_unit(t)`` of the trained tokens, and its statistics.

    All tensors are 1-D over the same trained tokens; ``unit_ids`` holds each token's unit in
    ``[0, num_units)``. ``logprobs`` carries the gradient; the other columns are data. The computation runs in
    ``logprobs``' dtype (call with float32 or float64 log-probs, also for a bfloat16 model).
    """
    n = logprobs.shape[0]
    for name, tensor in (
        ("behaviour_logprobs", behaviour_logprobs),
        ("advantages", advantages),
        ("token_weights", token_weights),
        ("unit_ids", unit_ids),
    ):
        if tensor.shape != (n,):
            raise ValueError(f"gspo_loss: {name} has shape {tuple(tensor.shape)}, expected ({n},) like logprobs")
    dtype = logprobs.dtype
    behaviour = behaviour_logprobs.to(dtype)
    advantage = advantages.to(dtype)
    weight = token_weights.to(dtype)
    unit_ids = unit_ids.long()

    token_log_ratio = logprobs - behaviour
    unit_log_ratio = sequence_log_ratios(token_log_ratio, unit_ids, num_units)
    ratio = torch.exp(unit_log_ratio.clamp(max=config.max_log_ratio))[unit_ids]
    clipped = ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    # truncated IS: value min(s, C), gradient min(s, C) * grad(log s)
    weighted = ratio * (config.tis_cap / ratio).clamp(max=1.0).detach() if config.tis_cap is not None else ratio
    objective = torch.minimum(weighted * advantage, clipped * advantage)
    loss_sum = -(weight * objective).sum()

    with torch.no_grad():
        value = ratio.detach()
        clip_active = ((advantage > 0) & (value > 1.0 + config.eps_high)) | (
            (advantage < 0) & (value < 1.0 - config.eps_low)
        )
        truncated = (
            (advantage < 0) & (value > config.tis_cap) if config.tis_cap is not None else torch.zeros_like(clip_active)
        )
        present = torch.zeros(num_units, dtype=torch.bool, device=unit_ids.device)
        present[unit_ids] = True
        stats = LossStats(
            loss_sum=float(loss_sum.detach()),
            weight=float(weight.sum()),
            tokens=n,
            units=int(present.sum()),
            clipped_weight=float(weight[clip_active].sum()),
            truncated_weight=float(weight[truncated].sum()),
            log_ratio_sum=float(unit_log_ratio.detach()[present].sum()),
            abs_token_log_ratio_sum=float(token_log_ratio.detach().abs().sum()),
            max_abs_token_log_ratio=float(token_log_ratio.detach().abs().max()) if n else 0.0,
            kl_sum=float(torch.expm1(token_log_ratio.detach()).sub(token_log_ratio.detach()).sum()),
            neg_logprob_sum=float(-logprobs.detach().sum()),
        )
    return loss_sum, stats
