"""The decoupled objective (pi_theta, pi_old, mu) against float64 formulas, gradients included.

Every case has a real gap: pi_old != mu (training-inference mismatch) and pi_theta != pi_old
(a later minibatch update). For grpo with token_mean over N tokens, d loss / d logp_t =
-c_t / N, and the per-token coefficient c_t must be (policy_loss.py's docstring):
    recompute:            c_t = w_t A_t r_t 1[not clipped], r_t = pi_theta / pi_old,
                          w_t = band(pi_old / mu at the level)
    generator, no weight: c_t = m_t A_t r_t 1[not clipped], r_t = pi_theta / mu,
                          m_t = 1 inside the band of pi_theta / mu (mask, keep_weight=false)
    generator, bypass:    c_t = w_t A_t, w_t = band(pi_theta / mu at the level)
Shape suffixes: N = loss tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan_rl.losses.corrections import CorrectionConfig, check_objective
from torchtitan_rl.losses.objective import microbatch_objective
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.reductions import results

LENGTHS = (3, 4, 2, 5)
CLIP = 0.2


def make_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])
    n = seq.shape[0]
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.1
    gen = old - torch.randn(n, generator=g, dtype=torch.float64) * 0.3  # mismatch
    lp = old + torch.randn(n, generator=g, dtype=torch.float64) * 0.15  # staleness
    adv = torch.randn(len(LENGTHS), generator=g, dtype=torch.float64)[seq]
    return lp, old, gen, adv, seq


def band_weight(log_ratio, seq, cfg):
    """Python floats: the level's log-weight per token, then truncate or mask."""
    out = []
    for t, s in enumerate(seq):
        members = [u for u in range(len(seq)) if seq[u] == s]
        lw = {
            "token": log_ratio[t],
            "sequence": sum(log_ratio[u] for u in members),
            "geometric": sum(log_ratio[u] for u in members) / len(members),
        }[cfg.level]
        w = math.exp(lw)
        inside = cfg.ratio_min <= w <= cfg.ratio_max
        if cfg.action == "truncate":
            out.append(min(max(w, cfg.ratio_min), cfg.ratio_max))
        else:
            out.append((w if cfg.keep_weight else 1.0) if inside else 0.0)
    return out


def expected_coefficients(lp, old, gen, adv, seq, mode, cfg):
    lp, old, gen, adv, seq = (x.tolist() for x in (lp, old, gen, adv, seq))
    n = len(lp)
    pi_old = old if mode == "recompute" else gen
    trainer = old if mode == "recompute" else lp  # whose ratio to mu the correction sees
    weights = [1.0] * n
    if cfg.level != "none":
        weights = band_weight([trainer[t] - gen[t] for t in range(n)], seq, cfg)
    bypass = (
        mode == "generator"
        and cfg.level != "none"
        and (cfg.action == "truncate" or cfg.keep_weight)
    )
    coefficients = []
    for t in range(n):
        if bypass:
            coefficients.append(weights[t] * adv[t])
            continue
        r = math.exp(lp[t] - pi_old[t])
        clipped = (adv[t] > 0 and r > 1 + CLIP) or (adv[t] < 0 and r < 1 - CLIP)
        coefficients.append(0.0 if clipped else weights[t] * adv[t] * r)
    return torch.tensor(coefficients, dtype=torch.float64)


def gradient_coefficients(lp, old, gen, adv, seq, mode, cfg):
    lp = lp.clone().requires_grad_()
    loss, metrics = microbatch_objective(
        lp, old if mode == "recompute" else None, gen, adv, seq,
        loss=LossConfig(old_logprobs=mode), correction=cfg,
        num_global_tokens=lp.shape[0], num_global_sequences=len(LENGTHS),
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    return -grad * lp.shape[0], results(metrics)


CORRECTIONS = [CorrectionConfig()] + [
    CorrectionConfig(level=level, action=action, keep_weight=keep, ratio_min=0.8, ratio_max=1.25)
    for level in ("token", "sequence", "geometric")
    for action, keep in (("truncate", True), ("mask", True), ("mask", False))
]


@pytest.mark.parametrize("mode", ["recompute", "generator"])
@pytest.mark.parametrize("cfg", CORRECTIONS, ids=repr)
def test_gradient_coefficient_of_each_mode_matches_float64_formula(mode, cfg):
    case = make_case()
    got, _ = gradient_coefficients(*case, mode, cfg)
    torch.testing.assert_close(got, expected_coefficients(*case, mode, cfg), rtol=1e-12, atol=1e-14)


def test_case_exercises_clipping_and_both_edges_of_the_band():
    lp, old, gen, adv, seq = make_case()
    r = torch.exp(lp - old)
    c = torch.exp(old - gen)
    assert ((r > 1 + CLIP) | (r < 1 - CLIP)).any()
    assert (c < 0.8).any() and (c > 1.25).any()


def test_token_truncate_weights_once_at_the_first_update():
    """pi_theta = pi_old, log(pi_old / mu) = [0.1, -0.05, 0.15], A = 1: the coefficient is
    pi_old / mu = [1.1052, 0.9512, 1.1618] (TRL's formula), not its square
    [1.2214, 0.9048, 1.3499] (the ratio applied twice)."""
    old = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    gen = old - torch.tensor([0.1, -0.05, 0.15], dtype=torch.float64)
    adv, seq = torch.ones(3, dtype=torch.float64), torch.tensor([0, 0, 1])
    cfg = CorrectionConfig(level="token", action="truncate", ratio_max=10.0)
    for mode in ("recompute", "generator"):
        lp = old.clone().requires_grad_()
        loss, _ = microbatch_objective(
            lp, old if mode == "recompute" else None, gen, adv, seq,
            loss=LossConfig(old_logprobs=mode, clip_high=10.0), correction=cfg,
            num_global_tokens=3, num_global_sequences=2,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss, lp)
        torch.testing.assert_close(-3 * grad, torch.exp(old - gen), rtol=1e-12, atol=0)
        assert (-3 * grad).tolist() == pytest.approx([1.1052, 0.9512, 1.1618], abs=1e-4)


def test_mismatch_metrics_measure_the_trainer_side_of_each_mode():
    lp, old, gen, adv, seq = make_case(1)
    gen[2] = math.nan
    finite = torch.isfinite(gen)
    for mode, trainer in (("recompute", old), ("generator", lp)):
        _, metrics = gradient_coefficients(lp, old, gen, adv, seq, mode, CorrectionConfig())
        gap = (trainer - gen).abs()[finite]
        assert metrics["trainer/logprob_diff/max"] == pytest.approx(gap.max().item(), rel=1e-12)
        assert metrics["trainer/logprob_diff/mean"] == pytest.approx(gap.mean().item(), rel=1e-12)
        assert metrics["loss/generator_logprob_nan_frac"] == pytest.approx(1 / len(lp))


def test_nonfinite_generator_logprob_leaves_the_loss_in_recompute_mode():
    lp, old, gen, adv, seq = make_case(2)
    gen[4] = math.nan
    cfg = CorrectionConfig(level="geometric", action="mask", ratio_min=0.1, ratio_max=10)
    coefficients, metrics = gradient_coefficients(lp, old, gen, adv, seq, "recompute", cfg)
    assert coefficients[4] == 0 and torch.isfinite(coefficients).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_combinations_without_a_sound_meaning_are_rejected():
    for name, level in (("gspo", "geometric"), ("cispo", "token")):
        truncate = CorrectionConfig(level=level, action="truncate")
        with pytest.raises(ValueError, match="loss.old_logprobs"):
            check_objective(LossConfig(name=name, old_logprobs="generator"), truncate)
        check_objective(LossConfig(name=name, old_logprobs="recompute"), truncate)
        rejection = CorrectionConfig(level=level, action="mask", keep_weight=False)
        check_objective(LossConfig(name=name, old_logprobs="generator"), rejection)
