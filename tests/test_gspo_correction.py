"""GSPO with a mismatch correction against TRL's GSPO formula, float64, gradients included.

TRL (GRPOTrainer, importance_sampling_level="sequence") differentiates the sequence ratio
through every token: log s_i = mean over t in i of (logp_t - old_t), each token's loss is
-w_t min(s_i A_i, clip(s_i) A_i), so d loss / d logp_t' = -A_i s_i 1[.] mean_t(w_t) / |y_i|
(seq_mean_token_mean, one sequence). Our token form gives -w_t' A_i s_i 1[.] / |y_i|: the
same when w is constant over the sequence (level sequence or geometric), not with a token
level weight, which config validation therefore refuses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchtitan_rl.config import ConfigError, load_config
from torchtitan_rl.losses.corrections import CorrectionConfig, correction_weights
from torchtitan_rl.losses.policy_loss import LossConfig, policy_loss

TINY = Path(__file__).resolve().parents[1] / "train_configs" / "alphabet_sort_tiny.toml"
LENGTHS = (3, 4, 2, 5)
CLIP = 0.2
RECOMPUTE_GSPO = ["--loss.name=gspo", "--loss.old_logprobs=recompute"]


def make_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])
    n = seq.shape[0]
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.1
    gen = old - torch.randn(n, generator=g, dtype=torch.float64) * 0.3  # mismatch
    lp = old + torch.randn(n, generator=g, dtype=torch.float64) * 0.1  # staleness
    adv = torch.randn(len(LENGTHS), generator=g, dtype=torch.float64)[seq]
    return lp, old, gen, adv, seq


def trl_gspo_loss(lp, old, adv, seq, weights):
    """TRL's sequence-level loss, hand-written per sequence (plain Python over tokens)."""
    loss = torch.zeros((), dtype=torch.float64)
    for i in range(len(LENGTHS)):
        ts = [t for t in range(seq.shape[0]) if seq[t] == i]
        s = torch.exp(sum(lp[t] - old[t] for t in ts) / len(ts))
        a = float(adv[ts[0]])
        term = -torch.minimum(s * a, torch.clamp(s, 1 - CLIP, 1 + CLIP) * a)
        loss = loss + sum(float(weights[t]) * term for t in ts) / len(ts) / len(LENGTHS)
    return loss


def both_gradients(level):
    lp, old, gen, adv, seq = make_case()
    weights, _ = correction_weights(
        old, gen, lp, adv, seq, config=CorrectionConfig(level=level, ratio_max=1.3),
        num_sequences=len(LENGTHS),
    )  # fmt: skip
    ours_lp, trl_lp = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    ours, _ = policy_loss(
        ours_lp, old, adv, seq, config=LossConfig(name="gspo", aggregation="seq_mean_token_mean"),
        num_global_tokens=seq.shape[0], num_global_sequences=len(LENGTHS),
        correction_weights_N=weights,
    )  # fmt: skip
    trl = trl_gspo_loss(trl_lp, old, adv, seq, weights)
    torch.testing.assert_close(ours, trl, rtol=1e-12, atol=1e-15)
    return torch.autograd.grad(ours, ours_lp)[0], torch.autograd.grad(trl, trl_lp)[0], seq


@pytest.mark.parametrize("level", ["none", "sequence", "geometric"])
def test_gspo_with_a_sequence_constant_weight_matches_trl_per_token(level):
    ours, trl, _ = both_gradients(level)
    assert (ours != 0).sum() >= 5  # some sequences are not clipped
    torch.testing.assert_close(ours, trl, rtol=1e-12, atol=1e-15)


def test_a_token_level_weight_is_where_the_two_forms_differ_so_it_is_refused():
    ours, trl, seq = both_gradients("token")
    sums = [
        torch.zeros(len(LENGTHS), dtype=torch.float64).index_add(0, seq, g) for g in (ours, trl)
    ]
    torch.testing.assert_close(*sums, rtol=1e-12, atol=1e-15)  # per sequence they agree
    assert ((ours - trl).abs() / trl.abs().clamp(min=1e-12)).max() > 0.1  # per token not
    with pytest.raises(ConfigError, match="correction.level='token' with loss.name='gspo'"):
        load_config(TINY, [*RECOMPUTE_GSPO, "--correction.level=token"])
    load_config(TINY, [*RECOMPUTE_GSPO, "--correction.level=geometric"])
