"""The +-20 log-ratio cap bounds the gradient instead of cutting it (float64, autograd vs
hand-written per-token coefficients from policy_loss.py's docstring).

Across the bound (log-ratios 19.9, 20.0, 20.1, -20.1), with r = exp(min(max(x, -20), 20)):
    grpo: g_t = -A_t r_t 1[not clipped]                 (clipped: A > 0 and r > 1 + clip_high,
                                                          or A < 0 and r < 1 - clip_low)
    k1: g = 1 | k2: g = -d | k3: g = 1 - exp(d), d = min(max(ref - logp, -20), 20)
so a token at 20.1 gets the coefficient of a token at 20, where the old clamp gave 0.
"""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan_rl.losses.policy_loss import LOG_RATIO_CLAMP, LossConfig, policy_loss

LOG_RATIOS = (19.9, 20.0, 20.1, -20.1)


def _cap(x: float) -> float:
    return min(max(x, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)


def _grpo_coefficient(log_ratio: float, adv: float, cfg: LossConfig) -> float:
    r = math.exp(_cap(log_ratio))
    clipped = (adv > 0 and r > 1 + cfg.clip_high) or (adv < 0 and r < 1 - cfg.clip_low)
    return 0.0 if clipped else -adv * r


def _kl_coefficient(d: float, estimator: str) -> float:
    d = _cap(d)
    return {"k1": 1.0, "k2": -d, "k3": 1.0 - math.exp(d)}[estimator]


def _grad(lp, old, adv, **kwargs):
    lp = lp.clone().requires_grad_(True)
    n = lp.shape[0]
    loss, _ = policy_loss(
        lp, old, adv, torch.arange(n), num_global_tokens=n, num_global_sequences=n, **kwargs
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad


@pytest.mark.parametrize("adv", [-1.5, 0.7])
def test_ppo_ratio_gradient_past_the_cap_equals_the_gradient_at_it(adv):
    cfg = LossConfig()
    lp = torch.full((4,), -2.0, dtype=torch.float64)
    old = lp - torch.tensor(LOG_RATIOS, dtype=torch.float64)
    advs = torch.full((4,), adv, dtype=torch.float64)
    loss, grad = _grad(lp, old, advs, config=cfg)
    want = [_grpo_coefficient(x, adv, cfg) / 4 for x in LOG_RATIOS]
    want = torch.tensor(want, dtype=torch.float64)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)
    assert torch.isfinite(loss)
    if adv < 0:  # the case the old clamp cut: 4.4e8 at 19.9, 0 at 20.1
        assert grad[2] == grad[1] > 0.99 * grad[0] > 1e8 / 4
    else:  # ratio e^-20.1: unclipped for A > 0, its small gradient is kept too
        assert grad[3] == pytest.approx(-adv * math.exp(-20) / 4, rel=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_gradient_past_the_cap_equals_the_gradient_at_it(estimator):
    cfg = LossConfig(kl_coef=0.5, kl_estimator=estimator)
    lp = torch.full((4,), -3.0, dtype=torch.float64)
    ref = lp + torch.tensor(LOG_RATIOS, dtype=torch.float64)  # d = ref - logp
    zero = torch.zeros(4, dtype=torch.float64)  # A = 0: only the KL term has a gradient
    _, grad = _grad(lp, lp.clone(), zero, config=cfg, ref_logprobs_N=ref)
    want = [cfg.kl_coef * _kl_coefficient(d, estimator) / 4 for d in LOG_RATIOS]
    torch.testing.assert_close(grad, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    assert grad[2] == grad[1] and grad[3] != 0


def test_capped_value_is_exact_and_a_nonfinite_token_still_leaves_the_loss():
    cfg = LossConfig()
    lp = torch.tensor([-1.0, -1.0, float("nan"), -1.0], dtype=torch.float64)
    old = torch.tensor([-21.1, -1.0, -1.0, float("-inf")], dtype=torch.float64)
    adv = torch.tensor([-1.0, 2.0, 5.0, 5.0], dtype=torch.float64)
    loss, grad = _grad(lp, old, adv, config=cfg)
    # two valid tokens of four: numerator and denominator both count only those two
    loss_2, grad_2 = _grad(lp[:2], old[:2], adv[:2], config=cfg)
    torch.testing.assert_close(loss * 4 / 2, loss_2, rtol=1e-14, atol=0)
    assert loss * 4 == math.exp(20.0) - 2.0  # -A r = e^20 exactly at the cap, -2 * 1
    torch.testing.assert_close(grad[:2] * 4 / 2, grad_2, rtol=1e-14, atol=0)
    assert grad[2] == grad[3] == 0
