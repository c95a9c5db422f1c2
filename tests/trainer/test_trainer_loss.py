"""GSPO loss: hand-computed cases, a float64 plain-Python reference, and the invariants the trainer relies on."""

import math
import subprocess
import sys

import pytest
import torch

from gyre.trainer import GSPOConfig, TrainerConfigError, gspo_loss
from gyre.trainer.loss import LossStats

F64 = torch.float64


def run(logp, behaviour, adv, weights, units, config=None, num_units=None):
    logp = torch.tensor(logp, dtype=F64, requires_grad=True)
    loss, stats = gspo_loss(
        logp,
        torch.tensor(behaviour, dtype=F64),
        torch.tensor(adv, dtype=F64),
        torch.tensor(weights, dtype=F64),
        torch.tensor(units),
        num_units if num_units is not None else max(units) + 1,
        config or GSPOConfig(),
    )
    loss.backward()
    return float(loss.detach()), logp.grad.tolist(), stats


def test_ratio_one_is_unclipped_policy_gradient():
    # one unit, two tokens whose log-ratios cancel: s = 1; loss = -(0.25 + 0.25) * 2; dloss/dlogp = -W A s / n
    loss, grad, stats = run([-1.0, -2.0], [-1.1, -1.9], [2.0, 2.0], [0.25, 0.25], [0, 0])
    assert loss == pytest.approx(-1.0, abs=1e-12)
    assert grad == pytest.approx([-0.5, -0.5], abs=1e-12)
    assert stats.units == 1 and stats.tokens == 2 and stats.clip_fraction == 0.0


def test_positive_advantage_above_the_clip_gets_no_gradient():
    s = math.exp(0.01)  # above 1 + 4e-4
    loss, grad, stats = run([-1.0], [-1.01], [1.0], [0.5], [0])
    assert s > 1 + 4e-4
    assert loss == pytest.approx(-0.5 * (1 + 4e-4), abs=1e-12)
    assert grad == [0.0]
    assert stats.clip_fraction == 1.0


def test_negative_advantage_below_the_clip_gets_no_gradient():
    loss, grad, stats = run([-1.01], [-1.0], [-1.0], [0.5], [0])
    assert loss == pytest.approx(0.5 * (1 - 3e-4), abs=1e-12)
    assert grad == [0.0]
    assert stats.clip_fraction == 1.0


def test_negative_advantage_above_the_clip_keeps_its_gradient_up_to_the_tis_cap():
    s = math.exp(0.01)
    loss, grad, stats = run([-1.0, -1.0], [-1.01, -1.01], [-1.0, -1.0], [0.5, 0.5], [0, 0])
    assert loss == pytest.approx(s, abs=1e-12)  # -W * s * A with W = 1, A = -1
    assert grad == pytest.approx([s / 2, s / 2], abs=1e-12)  # -W A s / n
    assert stats.clip_fraction == 0.0 and stats.truncated_fraction == 0.0


def test_tis_truncates_the_ratio_at_the_cap_but_keeps_the_direction():
    # s = e > cap 2: the value is 2 A, the gradient is 2 A times the mean score function
    loss, grad, stats = run([-1.0], [-2.0], [-1.0], [1.0], [0])
    assert loss == pytest.approx(2.0, abs=1e-12)
    assert grad == pytest.approx([2.0], abs=1e-12)
    assert stats.truncated_fraction == 1.0
    off, off_grad, off_stats = run([-1.0], [-2.0], [-1.0], [1.0], [0], GSPOConfig(tis_cap=None))
    assert off == pytest.approx(math.e, abs=1e-12)
    assert off_grad == pytest.approx([math.e], abs=1e-12)
    assert off_stats.truncated_fraction == 0.0


def test_positive_advantage_below_one_is_unclipped():
    loss, grad, _ = run([-1.02, -1.0], [-1.0, -1.0], [3.0, 3.0], [0.1, 0.3], [0, 0])  # mean log-ratio -0.01
    s = math.exp(-0.01)
    assert loss == pytest.approx(-0.4 * 3.0 * s, abs=1e-12)
    assert grad == pytest.approx([-0.4 * 3.0 * s / 2] * 2, abs=1e-12)


def test_units_are_independent():
    # unit 0 is clipped (no gradient), unit 1 is not; neither leaks into the other
    loss, grad, stats = run([-1.0, -1.0, -3.0], [-1.5, -1.5, -3.0], [1.0, 1.0, 1.0], [0.2, 0.2, 0.6], [0, 0, 1])
    assert grad[:2] == [0.0, 0.0]
    assert grad[2] == pytest.approx(-0.6, abs=1e-12)
    assert loss == pytest.approx(-0.4 * (1 + 4e-4) - 0.6, abs=1e-12)
    assert stats.units == 2
    assert stats.clipped_weight == pytest.approx(0.4)


def reference(logp, behaviour, adv, weights, units, config):
    """Plain-Python float64 GSPO: loss and its gradient, case by case (no autograd)."""
    members: dict[int, list[int]] = {}
    for t, u in enumerate(units):
        members.setdefault(u, []).append(t)
    loss, grad = 0.0, [0.0] * len(logp)
    for tokens in members.values():
        n = len(tokens)
        s = math.exp(min(sum(logp[t] - behaviour[t] for t in tokens) / n, config.max_log_ratio))
        for t in tokens:
            a, w = adv[t], weights[t]
            clipped = min(max(s, 1 - config.eps_low), 1 + config.eps_high)
            weighted = min(s, config.tis_cap) if config.tis_cap is not None else s
            if weighted * a <= clipped * a:  # the importance-weighted branch is the minimum
                loss -= w * weighted * a
                for k in tokens:  # d(weighted)/d(logp_k) = weighted / n (the truncation factor is a constant)
                    grad[k] -= w * a * weighted / n
            else:
                loss -= w * clipped * a
                if 1 - config.eps_low < s < 1 + config.eps_high:
                    for k in tokens:
                        grad[k] -= w * a * s / n
    return loss, grad


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "config",
    [GSPOConfig(), GSPOConfig(tis_cap=None), GSPOConfig(eps_low=0.2, eps_high=0.27, tis_cap=1.5)],
    ids=["paper", "no-tis", "grpo-clip"],
)
def test_matches_the_float64_reference(seed, config):
    g = torch.Generator().manual_seed(seed)
    n, units = 40, 7
    unit_ids = torch.randint(0, units, (n,), generator=g)
    unit_adv = torch.randn(units, generator=g, dtype=F64)
    behaviour = -torch.rand(n, generator=g, dtype=F64) * 5
    scale = [1e-4, 1e-3, 0.05, 0.5, 2.0][seed % 5]  # from inside the clip range to far beyond the TIS cap
    logp = behaviour + torch.randn(n, generator=g, dtype=F64) * scale
    weights = torch.rand(n, generator=g, dtype=F64)
    args = (logp.tolist(), behaviour.tolist(), unit_adv[unit_ids].tolist(), weights.tolist(), unit_ids.tolist())
    want_loss, want_grad = reference(*args, config)
    loss, grad, stats = run(*args, config, num_units=units)
    assert loss == pytest.approx(want_loss, abs=1e-6)
    assert grad == pytest.approx(want_grad, abs=1e-6)
    assert stats.loss_sum == pytest.approx(loss)
    assert stats.weight == pytest.approx(float(weights.sum()))


def test_order_and_splitting_by_unit_do_not_change_the_result():
    g = torch.Generator().manual_seed(7)
    n = 30
    units = torch.randint(0, 5, (n,), generator=g)
    logp, behaviour = -torch.rand(n, generator=g, dtype=F64), -torch.rand(n, generator=g, dtype=F64)
    adv, w = torch.randn(5, generator=g, dtype=F64)[units], torch.rand(n, generator=g, dtype=F64)
    config = GSPOConfig(eps_low=0.5, eps_high=0.5, tis_cap=None)
    whole, stats = gspo_loss(logp, behaviour, adv, w, units, 5, config)
    perm = torch.randperm(n, generator=g)
    shuffled, _ = gspo_loss(logp[perm], behaviour[perm], adv[perm], w[perm], units[perm], 5, config)
    assert float(shuffled) == pytest.approx(float(whole), abs=1e-12)
    parts = LossStats()
    for chosen in (units < 2, units >= 2):  # two forward passes holding disjoint units
        _, part = gspo_loss(logp[chosen], behaviour[chosen], adv[chosen], w[chosen], units[chosen], 5, config)
        parts = parts + part
    assert parts.loss_sum == pytest.approx(stats.loss_sum, abs=1e-12)
    assert parts.units == stats.units and parts.tokens == stats.tokens


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="advantages"):
        gspo_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2), torch.zeros(3), torch.zeros(3, dtype=torch.long), 1,
                  GSPOConfig())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"eps_low": 1.0}, "eps_low"), ({"eps_high": -1}, "eps_high"), ({"tis_cap": 1.0}, "tis_cap"),
     ({"max_log_ratio": 0}, "max_log_ratio")],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(TrainerConfigError, match=field):
        GSPOConfig(**kwargs)


def test_the_loss_module_imports_no_servers_or_models():
    code = (
        "import sys, gyre.trainer.loss; "
        "heavy = [m for m in ('transformers', 'megatron', 'fastapi', 'uvicorn', 'grpc', 'gyre.log', 'gyre.engine') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_mismatch_statistics_match_a_float64_reference_and_merge():
    """KL (k3), entropy estimate and |log-ratio| mean/max, per call and merged across passes."""
    g = torch.Generator().manual_seed(3)
    n = 40
    units = torch.randint(0, 4, (n,), generator=g)
    logp, behaviour = -torch.rand(n, generator=g, dtype=F64) * 3, -torch.rand(n, generator=g, dtype=F64) * 3
    adv, w = torch.randn(4, generator=g, dtype=F64)[units], torch.rand(n, generator=g, dtype=F64)
    config = GSPOConfig(eps_low=0.2, eps_high=0.2, tis_cap=2.0)
    _, stats = gspo_loss(logp, behaviour, adv, w, units, 4, config)
    ratio = (logp - behaviour).tolist()
    k3 = [math.exp(r) - 1 - r for r in ratio]
    assert stats.kl == pytest.approx(sum(k3) / n, rel=1e-12) and stats.kl > 0
    assert stats.entropy == pytest.approx(-sum(logp.tolist()) / n, rel=1e-12)
    assert stats.mean_abs_token_log_ratio == pytest.approx(sum(abs(r) for r in ratio) / n, rel=1e-12)
    assert stats.max_abs_token_log_ratio == pytest.approx(max(abs(r) for r in ratio), rel=1e-12)
    merged = LossStats()
    for chosen in (units < 2, units >= 2):
        _, part = gspo_loss(logp[chosen], behaviour[chosen], adv[chosen], w[chosen], units[chosen], 4, config)
        merged = merged + part
    assert merged.max_abs_token_log_ratio == stats.max_abs_token_log_ratio  # merged by max, not summed
    assert merged.kl == pytest.approx(stats.kl, rel=1e-12)
    assert merged.entropy == pytest.approx(stats.entropy, rel=1e-12)


def test_on_policy_tokens_have_no_mismatch():
    logp = torch.tensor([-0.5, -1.5, -2.0], dtype=F64)
    _, stats = gspo_loss(logp, logp.clone(), torch.ones(3, dtype=F64), torch.ones(3, dtype=F64),
                         torch.zeros(3, dtype=torch.long), 1, GSPOConfig())
    assert stats.kl == 0.0 and stats.max_abs_token_log_ratio == 0.0 and stats.clip_fraction == 0.0
    assert stats.entropy == pytest.approx(4.0 / 3)
