"""policy_loss against a float64 reference written token by token in plain Python.

Reference, per valid token t (finite trainer log-prob and pi_old) of sequence i:
  log r_t = clamp(logp_t - old_t, -20, 20), r_t = exp(log r_t)  (this batch stays inside
  the bound; test_log_ratio_cap.py checks the gradient across it)
  grpo/dapo/dr_grpo: l_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)
  gspo: s_i = exp(mean of log r over i's valid tokens), rho_t = sg[s_i] exp(logp_t - sg[logp_t]),
        l_t = -min(rho_t A_t, clip(rho_t, ...) A_t)
  cispo: l_t = -sg[min(r_t, 1 + clip_high)] A_t logp_t
  bypass: l_t = -A_t logp_t
  total_t = w_t l_t + kl_coef KL_t - entropy_coef H_t, KL_t = k1, k2 or k3 of (ref_t - logp_t)
Aggregation: token_mean = sum_t total_t / num_global_tokens; seq_mean_token_sum =
sum_i sum_{t in i} total_t / num_global_sequences; seq_mean_token_mean = sum_i (sum_{t in i}
total_t / |valid tokens of i|) / num_global_sequences; dr_grpo = sum_t total_t /
(normalizer * num_global_sequences).
Shape suffixes: N = loss tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan_rl.losses.policy_loss import LOG_RATIO_CLAMP, LOSSES, LossConfig, policy_loss
from torchtitan_rl.reductions import results

SEQ_LENGTHS = (3, 5, 1, 6, 4)


def plain(metrics):
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in results(metrics).items()}


def reference_loss(
    lp_N, gen_N, adv_N, seq_N, cfg, num_tokens, num_seqs, ent_N, ref_N, w_N, bypass=False
):
    lp, gen = list(lp_N), gen_N.tolist()
    valid = [math.isfinite(g) and math.isfinite(x.item()) for g, x in zip(gen, lp)]
    members = {}
    for t, s in enumerate(seq_N.tolist()):
        if valid[t]:
            members.setdefault(s, []).append(t)

    def log_ratio(t):
        return torch.clamp(lp[t] - gen[t], -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    def clipped_surrogate(ratio, adv):
        clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
        return -torch.minimum(ratio * adv, clipped * adv)

    total = {}
    for ts in members.values():
        seq_log_ratio = sum(log_ratio(t).item() for t in ts) / len(ts)
        for t in ts:
            adv = float(adv_N[t])
            if bypass:
                term = -adv * lp[t]
            elif cfg.name == "gspo":
                rho = math.exp(seq_log_ratio) * torch.exp(lp[t] - lp[t].detach())
                term = clipped_surrogate(rho, adv)
            elif cfg.name == "cispo":
                weight = min(math.exp(log_ratio(t).item()), 1 + cfg.clip_high)
                term = -weight * adv * lp[t]
            else:
                term = clipped_surrogate(torch.exp(log_ratio(t)), adv)
            if w_N is not None:
                term = term * float(w_N[t])
            if ref_N is not None:
                d = torch.clamp(ref_N[t] - lp[t], -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
                kl = {"k1": -d, "k2": d * d / 2}.get(cfg.kl_estimator, torch.exp(d) - d - 1)
                term = term + cfg.kl_coef * kl
            if ent_N is not None:
                term = term - cfg.entropy_coef * ent_N[t]
            total[t] = term
    aggregation = {"dapo": "token_mean", "dr_grpo": "dr_grpo"}.get(cfg.name, cfg.aggregation)
    loss = torch.zeros((), dtype=torch.float64)
    for ts in members.values():
        seq_sum = sum(total[t] for t in ts)
        if aggregation == "token_mean":
            loss = loss + seq_sum / num_tokens
        elif aggregation == "seq_mean_token_sum":
            loss = loss + seq_sum / num_seqs
        elif aggregation == "seq_mean_token_mean":
            loss = loss + seq_sum / len(ts) / num_seqs
        else:
            loss = loss + seq_sum / (cfg.dr_grpo_normalizer * num_seqs)
    return loss


def make_batch(seed=0, lengths=SEQ_LENGTHS, first_seq=0):
    gen = torch.Generator().manual_seed(seed)
    seq_N = torch.cat([torch.full((n,), first_seq + i) for i, n in enumerate(lengths)])
    n = seq_N.shape[0]
    lp_N = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    gen_N = lp_N + torch.randn(n, generator=gen, dtype=torch.float64) * 0.4
    adv_S = torch.randn(len(lengths) + first_seq, generator=gen, dtype=torch.float64)
    adv_N = adv_S[seq_N]
    ent_N = torch.rand(n, generator=gen, dtype=torch.float64) * 2
    ref_N = lp_N + torch.randn(n, generator=gen, dtype=torch.float64) * 0.3
    w_N = torch.rand(n, generator=gen, dtype=torch.float64) * 1.5
    return dict(lp=lp_N, gen=gen_N, adv=adv_N, seq=seq_N, ent=ent_N, ref=ref_N, w=w_N)


def run_both(batch, cfg, num_tokens, num_seqs, *, extras=True, bypass=False):
    ours_in = {k: v.clone().requires_grad_(k in ("lp", "ent")) for k, v in batch.items()}
    ref_in = {k: v.clone().requires_grad_(k in ("lp", "ent")) for k, v in batch.items()}
    loss, metrics = policy_loss(
        ours_in["lp"], ours_in["gen"], ours_in["adv"], ours_in["seq"], config=cfg,
        num_global_tokens=num_tokens, num_global_sequences=num_seqs,
        entropy_N=ours_in["ent"] if extras else None,
        ref_logprobs_N=ours_in["ref"] if extras else None,
        correction_weights_N=ours_in["w"] if extras else None, bypass=bypass,
    )  # fmt: skip
    want = reference_loss(
        list(ref_in["lp"]), ref_in["gen"], ref_in["adv"], ref_in["seq"], cfg, num_tokens,
        num_seqs, *((ref_in["ent"], ref_in["ref"], ref_in["w"]) if extras else (None,) * 3),
        bypass=bypass,
    )  # fmt: skip
    grads = torch.autograd.grad(loss, (ours_in["lp"], ours_in["ent"]), allow_unused=True)
    want_grads = torch.autograd.grad(want, (ref_in["lp"], ref_in["ent"]), allow_unused=True)
    return (loss, grads, plain(metrics)), (want, want_grads)


def config_for(name, aggregation):
    cfg = LossConfig(name=name, aggregation=aggregation, entropy_coef=0.03, kl_coef=0.1)
    if name == "dapo":
        cfg.clip_high = 0.28
    if name == "dr_grpo":
        cfg.dr_grpo_normalizer = 8.0
    return cfg


CASES = [
    (name, agg)
    for name in LOSSES
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
    if LOSSES[name].aggregation is None or agg == "token_mean"
]


def assert_grads_close(grads, want_grads):
    for got, want in zip(grads, want_grads):
        want = torch.zeros_like(got) if want is None else want
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("name", "aggregation"), CASES)
@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3"])
def test_loss_and_grads_match_float64_reference(name, aggregation, kl_estimator):
    cfg = config_for(name, aggregation)
    cfg.kl_estimator = kl_estimator
    cfg.validate()
    (loss, grads, _), (want, want_grads) = run_both(make_batch(), cfg, 40, 7)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    assert_grads_close(grads, want_grads)


@pytest.mark.parametrize("name", list(LOSSES))
def test_plain_surrogate_without_extras_matches_reference(name):
    cfg = config_for(name, "token_mean")
    (loss, grads, metrics), (want, want_grads) = run_both(make_batch(3), cfg, 19, 5, extras=False)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    assert_grads_close(grads[:1], want_grads[:1])
    torch.testing.assert_close(metrics["loss/policy"], want.detach())
    torch.testing.assert_close(metrics["loss/mean"], want.detach())
    assert "loss/kl" not in metrics and "loss/entropy" not in metrics


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo"])
def test_bypass_is_reinforce_weighted_once(name):
    """Bypass (generator mode, weight-carrying correction): the gradient coefficient is
    -w_t A_t with the corrected ratio w_t, whatever the PPO ratio and its clip would say."""
    cfg = config_for(name, "token_mean")
    (loss, grads, metrics), (want, want_grads) = run_both(make_batch(6), cfg, 19, 5, bypass=True)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    assert_grads_close(grads, want_grads)
    assert "loss/clip_frac" not in metrics


def test_clipping_happens_on_both_sides_in_the_test_batch():
    (_, _, metrics), _ = run_both(make_batch(), config_for("grpo", "token_mean"), 19, 5)
    assert 0 < metrics["loss/clip_frac"] < 1


@pytest.mark.parametrize(("name", "aggregation"), CASES)
def test_nonfinite_logprobs_leave_loss_and_grads_equal_to_clean_subset(name, aggregation):
    cfg = config_for(name, aggregation)
    batch = make_batch(1)
    dirty = {k: v.clone() for k, v in batch.items()}
    bad = torch.tensor([0, 4, 5, 12, 18])
    dirty["gen"][bad[:3]] = torch.tensor([math.nan, math.inf, -math.inf]).double()
    dirty["lp"][bad[3:]] = torch.tensor([math.nan, -math.inf]).double()
    keep = torch.ones(batch["lp"].shape[0], dtype=torch.bool)
    keep[bad] = False
    clean = {k: v[keep] for k, v in batch.items()}
    (loss, grads, metrics), (want, _) = run_both(dirty, cfg, 14, 7)
    (clean_loss, clean_grads, _), _ = run_both(clean, cfg, 14, 7)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, clean_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    for got, clean_grad in zip(grads, clean_grads):
        assert torch.isfinite(got).all()
        assert (got[bad] == 0).all()
        torch.testing.assert_close(got[keep], clean_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_microbatch_losses_sum_to_the_whole_batch(aggregation):
    cfg = config_for("grpo", aggregation)
    first = make_batch(2, lengths=(3, 5), first_seq=0)
    second = make_batch(5, lengths=(1, 6, 4), first_seq=2)
    whole = {k: torch.cat([first[k], second[k]]) for k in first}
    total = sum(run_both(part, cfg, 19, 5)[0][0] for part in (first, second))
    torch.testing.assert_close(total, run_both(whole, cfg, 19, 5)[0][0], rtol=1e-12, atol=1e-14)


def test_token_mean_of_whole_batch_is_the_plain_mean():
    batch = make_batch(4)
    cfg = LossConfig(name="grpo")
    loss, _ = policy_loss(
        batch["lp"], batch["gen"], batch["adv"], batch["seq"], config=cfg,
        num_global_tokens=19, num_global_sequences=5,
    )  # fmt: skip
    ratio = torch.exp(batch["lp"] - batch["gen"])
    per_token = -torch.minimum(ratio * batch["adv"], ratio.clamp(0.8, 1.2) * batch["adv"])
    torch.testing.assert_close(loss, per_token.mean())


def test_log_ratio_is_clamped_before_exp():
    lp = torch.tensor([-1.0, -1.0], requires_grad=True)
    gen = torch.tensor([-200.0, -1.0])  # log-ratio 199 would overflow exp in fp32
    adv = torch.tensor([-1.0, 1.0])
    seq = torch.tensor([0, 1])
    loss, metrics = policy_loss(
        lp, gen, adv, seq, config=LossConfig(), num_global_tokens=2, num_global_sequences=2
    )
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, torch.tensor((math.exp(LOG_RATIO_CLAMP) - 1.0) / 2))
    # past the cap the gradient is the one at the cap (-A e^20 / N), not 0
    assert grad[0] == pytest.approx(math.exp(LOG_RATIO_CLAMP) / 2)
    assert results(metrics)["loss/ratio_mean"] == pytest.approx((math.exp(20) + 1) / 2)


def test_gspo_ratio_is_sequence_level_and_gradient_is_per_token():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    gen = torch.tensor([-1.1, -1.9, -0.5], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    seq = torch.tensor([0, 0, 1])
    cfg = LossConfig(name="gspo", aggregation="seq_mean_token_mean")
    loss, metrics = policy_loss(
        lp, gen, adv, seq, config=cfg, num_global_tokens=3, num_global_sequences=2
    )
    (grad,) = torch.autograd.grad(loss, lp)
    s0 = math.exp(((-1.0 + 1.1) + (-2.0 + 1.9)) / 2)  # = 1: the two log-ratios cancel
    torch.testing.assert_close(loss, torch.tensor((-s0 + 1.0) / 2, dtype=torch.float64))
    # d/dlogp_t of -(1/G)(1/|y|) sum_t s_i,t A = -s_i A / (G |y|) for each token of sequence 0.
    torch.testing.assert_close(grad[:2], torch.full((2,), -s0 / 4, dtype=torch.float64))
    torch.testing.assert_close(grad[2], torch.tensor(0.5, dtype=torch.float64))
    assert results(metrics)["loss/ratio_mean"] == pytest.approx(1.0)


def test_config_errors_name_the_field():
    cases = [
        (dict(name="ppo"), "loss.name"),
        (dict(aggregation="sum"), "loss.aggregation"),
        (dict(name="dapo", clip_high=0.28, aggregation="seq_mean_token_sum"), "loss.aggregation"),
        (dict(name="dapo"), "loss.clip_high"),
        (dict(clip_low=1.0), "loss.clip_low"),
        (dict(clip_high=-0.1), "loss.clip_high"),
        (dict(dr_grpo_normalizer=0.0), "loss.dr_grpo_normalizer"),
        (dict(entropy_coef=-1.0), "loss.entropy_coef"),
        (dict(kl_estimator="k4"), "loss.kl_estimator"),
        (dict(old_logprobs="trainer"), "loss.old_logprobs"),
        (dict(kl_reference="/some/folder"), "loss.kl_reference"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=field):
            LossConfig(**kwargs).validate()
    LossConfig(name="dapo", clip_high=0.28).validate()
    LossConfig(name="dr_grpo").validate()


def test_empty_microbatch_gives_zero_loss_and_finite_metrics():
    empty = torch.zeros(0)
    loss, metrics = policy_loss(
        empty.requires_grad_(), empty, empty, empty.long(), config=LossConfig(),
        num_global_tokens=1, num_global_sequences=1,
    )  # fmt: skip
    assert loss == 0 and all(math.isfinite(v) for v in results(metrics).values())


def reference_log_ratios(lp_N, old_N, seq_N, name):
    """float64 |log r_t| per valid token: log r_t = logp_t - old_t, or for gspo the mean of
    its sequence's valid log-ratios (the sequence ratio s_i)."""
    lp, old, seq = lp_N.tolist(), old_N.tolist(), seq_N.tolist()
    valid = [math.isfinite(a) and math.isfinite(b) for a, b in zip(lp, old)]
    members = {}
    for t, s in enumerate(seq):
        if valid[t]:
            members.setdefault(s, []).append(t)
    out = []
    for ts in members.values():
        logs = [lp[t] - old[t] for t in ts]
        out += [abs(sum(logs) / len(logs))] * len(ts) if name == "gspo" else list(map(abs, logs))
    return out


@pytest.mark.parametrize(
    ("name", "bypass"),
    [(name, False) for name in LOSSES] + [(name, True) for name in ("grpo", "dapo", "dr_grpo")],
)
def test_log_ratio_metrics_match_float64_reference_on_valid_tokens_only(name, bypass):
    batch = make_batch(2)
    batch["gen"][[1, 9]] = torch.tensor([math.nan, -math.inf]).double()
    batch["lp"][4] = math.nan
    lp, old, seq = batch["lp"], batch["gen"], batch["seq"]
    _, metrics = policy_loss(
        lp, old, batch["adv"], seq, config=config_for(name, "token_mean"),
        num_global_tokens=16, num_global_sequences=5, bypass=bypass,
    )  # fmt: skip
    metrics = plain(metrics)
    want = reference_log_ratios(lp, old, seq, name)
    assert len(want) == 16 and max(want) > 0.3  # a real gap; three tokens left out
    torch.testing.assert_close(
        metrics["loss/log_ratio/abs_mean"], torch.tensor(sum(want) / 16).double()
    )
    torch.testing.assert_close(metrics["loss/log_ratio/abs_max"], torch.tensor(max(want)).double())


def test_log_ratio_metrics_resolve_a_gap_that_the_ratio_rounds_to_one():
    """float32, as the trainer runs: pi_theta one ulp from pi_old gives a ratio that rounds to
    exactly 1 (its chart reads 1 throughout), while |log r| keeps the gap to the last bit."""
    old = torch.tensor([-0.5, -0.3, -0.25, -0.4])  # gaps of 3e-8 and 1.5e-8: below half
    # of float32's 1.2e-7 step at 1, so exp rounds each ratio to 1 with room to spare
    lp = torch.nextafter(old, torch.zeros(()))  # one ulp towards 0: log-ratio > 0
    _, metrics = policy_loss(
        lp, old, torch.ones(4), torch.tensor([0, 0, 1, 1]), config=LossConfig(),
        num_global_tokens=4, num_global_sequences=2,
    )  # fmt: skip
    got = results(metrics)
    gaps = [(a - b) for a, b in zip(lp.double().tolist(), old.double().tolist())]
    assert got["loss/ratio_mean"] == 1.0
    assert got["loss/log_ratio/abs_mean"] == pytest.approx(sum(gaps) / 4, rel=1e-6)
    assert got["loss/log_ratio/abs_max"] == pytest.approx(max(gaps), rel=1e-6)
    assert 0 < min(gaps) < max(gaps) < 6e-8
