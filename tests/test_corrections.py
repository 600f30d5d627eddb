"""correction_weights against a float64 reference written token by token in plain Python.

Reference, over valid tokens (finite pi_old, mu and pi_theta), log c_t = old_t - gen_t:
  token: lw_t = log c_t; sequence: lw_t = sum of log c over t's sequence; geometric: the mean.
  truncate: w_t = min(max(exp(lw_t), ratio_min), ratio_max)
  mask: w_t = (exp(lw_t) if keep_weight else 1) when ratio_min <= exp(lw_t) <= ratio_max, else 0
  metrics: ratio_mean|min|max of exp(lw_t), log_ratio/abs_mean|abs_max of |lw_t|
  OPSM (TRL): w_t = 0 for every token of a sequence with mean A < 0 and
  mean (gen - lp) > opsm_delta, lp = pi_theta. Invalid tokens: w_t = 0.
Shape suffixes: N = loss tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan_rl.losses.corrections import CorrectionConfig, correction_weights
from torchtitan_rl.reductions import results


def weights_and_metrics(*args, **kwargs):
    weights, metrics = correction_weights(*args, **kwargs)
    return weights, {k: torch.tensor(v, dtype=torch.float64) for k, v in results(metrics).items()}


def reference(old_N, gen_N, lp_N, adv_N, seq_N, cfg):
    old, gen, lp = old_N.tolist(), gen_N.tolist(), lp_N.tolist()
    adv, seq = adv_N.tolist(), seq_N.tolist()
    valid = [all(map(math.isfinite, v)) for v in zip(old, gen, lp)]
    members = {}
    for t, s in enumerate(seq):
        if valid[t]:
            members.setdefault(s, []).append(t)
    log_r = {t: old[t] - gen[t] for ts in members.values() for t in ts}
    weights, ratios, log_ws, outside, dropped = [0.0] * len(lp), [], [], 0, set()
    for s, ts in members.items():
        seq_sum = sum(log_r[t] for t in ts)
        mean_adv = sum(adv[t] for t in ts) / len(ts)
        drift = sum(gen[t] - lp[t] for t in ts) / len(ts)
        if cfg.opsm_delta > 0 and mean_adv < 0 and drift > cfg.opsm_delta:
            dropped.add(s)
        for t in ts:
            lw = {"none": 0.0, "token": log_r[t], "sequence": seq_sum}.get(
                cfg.level, seq_sum / len(ts)
            )
            ratio = math.exp(lw)
            ratios.append(ratio)
            log_ws.append(lw)
            is_out = cfg.level != "none" and not cfg.ratio_min <= ratio <= cfg.ratio_max
            outside += is_out
            if cfg.level == "none":
                w = 1.0
            elif cfg.action == "truncate":
                w = min(max(ratio, cfg.ratio_min), cfg.ratio_max)
            else:
                w = 0.0 if is_out else (ratio if cfg.keep_weight else 1.0)
            weights[t] = 0.0 if s in dropped else w
    metrics = {}
    if cfg.level != "none":
        name = "masked_frac" if cfg.action == "mask" else "truncated_frac"
        metrics = {
            "correction/ratio_mean": sum(ratios) / len(ratios),
            "correction/ratio_min": min(ratios),
            "correction/ratio_max": max(ratios),
            "correction/log_ratio/abs_mean": sum(map(abs, log_ws)) / len(log_ws),
            "correction/log_ratio/abs_max": max(map(abs, log_ws)),
            f"correction/{name}": outside / len(ratios),
        }
    if cfg.opsm_delta > 0:
        metrics["correction/opsm_dropped_frac"] = len(dropped) / len(members)
    return torch.tensor(weights, dtype=torch.float64), metrics


def make_batch(seed=0, lengths=(3, 5, 1, 6, 4, 2)):
    """(pi_old, mu, pi_theta, advantages, sequence ids): a real gap between all three."""
    gen = torch.Generator().manual_seed(seed)
    seq_N = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    n = seq_N.shape[0]
    old_N = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    gen_N = old_N + torch.randn(n, generator=gen, dtype=torch.float64) * 0.5
    lp_N = old_N + torch.randn(n, generator=gen, dtype=torch.float64) * 0.2
    adv_N = torch.randn(len(lengths), generator=gen, dtype=torch.float64)[seq_N]
    return old_N, gen_N, lp_N, adv_N, seq_N


CONFIGS = [
    CorrectionConfig(level=level, action=action, ratio_min=rmin, ratio_max=2.0, keep_weight=keep)
    for level in ("none", "token", "sequence", "geometric")
    for action, keep in (("truncate", True), ("mask", True), ("mask", False))
    for rmin in (0.0, 0.7)
] + [
    CorrectionConfig(level="geometric", action="mask", ratio_min=0.6, opsm_delta=0.05),
    CorrectionConfig(level="none", opsm_delta=0.01),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=repr)
def test_weights_and_metrics_match_float64_reference(cfg):
    cfg.validate()
    batch = make_batch()
    weights, metrics = weights_and_metrics(*batch, config=cfg, num_sequences=6)
    want, want_metrics = reference(*batch, cfg)
    torch.testing.assert_close(weights, want, rtol=1e-12, atol=1e-14)
    assert set(metrics) == set(want_metrics)
    for key, value in want_metrics.items():
        torch.testing.assert_close(metrics[key], torch.tensor(value).double())


def test_reference_batch_exercises_both_sides_of_the_band():
    cfg = CorrectionConfig(level="token", ratio_min=0.7, ratio_max=1.4)
    _, metrics = weights_and_metrics(*make_batch(), config=cfg, num_sequences=6)
    assert metrics["correction/ratio_min"] < 0.7 and metrics["correction/ratio_max"] > 1.4


def test_weights_come_from_pi_old_and_never_from_pi_theta():
    """The mismatch weight is pi_old / mu: moving pi_theta changes no weight (only OPSM)."""
    old, gen, lp, adv, seq = make_batch(3)
    cfg = CorrectionConfig(level="token", ratio_max=10.0)
    weights, _ = correction_weights(old, gen, lp, adv, seq, config=cfg, num_sequences=6)
    moved, _ = correction_weights(old, gen, lp + 0.7, adv, seq, config=cfg, num_sequences=6)
    torch.testing.assert_close(weights, torch.exp(old - gen), rtol=1e-12, atol=0)
    torch.testing.assert_close(moved, weights, rtol=0, atol=0)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_nonfinite_logprobs_get_zero_weight_and_leave_the_sequence_sums(level):
    cfg = CorrectionConfig(level=level, action="mask", ratio_min=0.1, ratio_max=10.0)
    old, gen, lp, adv, seq = make_batch(1)
    bad = torch.tensor([1, 7, 12, 15])
    gen_dirty = gen.clone()
    gen_dirty[bad[:2]] = torch.tensor([math.nan, -math.inf], dtype=torch.float64)
    lp_dirty = lp.clone()
    lp_dirty[bad[2]] = math.nan
    old_dirty = old.clone()
    old_dirty[bad[3]] = math.inf
    dirty = (old_dirty, gen_dirty, lp_dirty, adv, seq)
    weights, metrics = weights_and_metrics(*dirty, config=cfg, num_sequences=6)
    keep = torch.ones_like(lp, dtype=torch.bool)
    keep[bad] = False
    clean, _ = correction_weights(
        old[keep], gen[keep], lp[keep], adv[keep], seq[keep], config=cfg, num_sequences=6
    )
    assert all(torch.isfinite(v) for v in metrics.values())
    assert (weights[bad] == 0).all()
    torch.testing.assert_close(weights[keep], clean)
    torch.testing.assert_close(weights, reference(*dirty, cfg)[0])


def test_geometric_ratio_is_length_invariant_but_sequence_product_is_not():
    lengths = (2, 9)
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    old = torch.full((11,), -1.0)
    gen = old + 0.3  # the same per-token ratio exp(-0.3) = 0.74 everywhere
    adv = torch.ones(11)
    geometric = CorrectionConfig(level="geometric", action="mask", ratio_min=0.5)
    weights, _ = correction_weights(old, gen, old, adv, seq, config=geometric, num_sequences=2)
    torch.testing.assert_close(weights, torch.full((11,), math.exp(-0.3)))
    product = CorrectionConfig(level="sequence", action="mask", ratio_min=0.5)
    weights, metrics = weights_and_metrics(old, gen, old, adv, seq, config=product, num_sequences=2)
    assert (weights[:2] > 0).all() and (weights[2:] == 0).all()  # exp(-0.6) in, exp(-2.7) out
    torch.testing.assert_close(metrics["correction/masked_frac"], torch.tensor(9 / 11).double())


def test_opsm_drops_exactly_negative_advantage_sequences_that_drifted():
    """TRL's OPSM: the drift is mean(log mu - log pi_theta), staleness included: here pi_old
    equals mu, so every bit of drift comes from pi_theta having moved."""
    # Per sequence: (mean advantage, per-token log pi_theta - log mu); delta = 0.1.
    cases = [(-1.0, -0.3), (-1.0, -0.05), (1.0, -0.3), (-1.0, 0.2), (-0.5, -0.11)]
    lengths = (3, 2, 4, 1, 5)
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    adv = torch.tensor([cases[s][0] for s in seq.tolist()])
    gen = torch.full((seq.shape[0],), -2.0)
    lp = gen + torch.tensor([cases[s][1] for s in seq.tolist()])
    cfg = CorrectionConfig(level="none", opsm_delta=0.1)
    weights, metrics = weights_and_metrics(gen, gen, lp, adv, seq, config=cfg, num_sequences=6)
    dropped = {s for s in range(5) if (weights[seq == s] == 0).all()}
    assert dropped == {0, 4}
    assert (weights[(seq != 0) & (seq != 4)] == 1).all()
    assert set(metrics) == {"correction/opsm_dropped_frac"}
    torch.testing.assert_close(metrics["correction/opsm_dropped_frac"], torch.tensor(0.4).double())


def test_weights_are_detached_and_large_sequence_ratios_do_not_overflow():
    lp = torch.zeros(500, requires_grad=True)
    gen = torch.full((500,), -1.0)  # sequence log-ratio 500: exp overflows float32
    cfg = CorrectionConfig(level="sequence", ratio_max=math.inf)
    weights, metrics = weights_and_metrics(
        lp.detach(), gen, lp, torch.ones(500), torch.zeros(500, dtype=torch.long),
        config=cfg, num_sequences=1,
    )  # fmt: skip
    assert not weights.requires_grad
    assert torch.isfinite(weights).all() and all(torch.isfinite(v) for v in metrics.values())


def test_level_none_gives_unit_weights_on_valid_tokens_and_no_ratio_metrics():
    old, gen, lp, adv, seq = make_batch(2)
    gen[3] = math.nan
    weights, metrics = weights_and_metrics(
        old, gen, lp, adv, seq, config=CorrectionConfig(), num_sequences=6
    )
    want = torch.ones_like(lp)
    want[3] = 0
    torch.testing.assert_close(weights, want)
    assert metrics == {}


def test_empty_microbatch_reports_no_extremes():
    empty = torch.zeros(0, dtype=torch.float64)
    cfg = CorrectionConfig(level="token")
    weights, metrics = weights_and_metrics(
        empty, empty, empty, empty, empty.long(), config=cfg, num_sequences=1
    )
    assert weights.numel() == 0 and metrics == {}


def test_config_errors_name_the_field():
    cases = [
        (dict(level="tok"), "correction.level"),
        (dict(action="clip"), "correction.action"),
        (dict(ratio_min=-0.1), "correction.ratio_min"),
        (dict(ratio_min=2.0, ratio_max=1.0), "correction.ratio_max"),
        (dict(keep_weight=False), "correction.keep_weight"),
        (dict(opsm_delta=-1.0), "correction.opsm_delta"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=field):
            CorrectionConfig(**kwargs).validate()
