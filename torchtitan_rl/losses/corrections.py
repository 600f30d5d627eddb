"""Training-inference mismatch corrections: weights built from pi_old / mu, and OPSM.

Three policies (docs/design.md): pi_theta is being trained, pi_old is the trainer's policy
at the step's first update (with asynchronous steps newer than the sampler), mu is the
generator that sampled. The PPO ratio pi_theta / pi_old lives
in `policy_loss`; this module builds the mismatch weight from pi_old / mu, once. Per loss
token t of sequence i, with log c_t = log pi_old(t) - log mu(t):

    token:      log w_t = log c_t
    sequence:   log w_t = sum over t' in i of log c_t'      (product of ratios)
    geometric:  log w_t = mean over t' in i of log c_t'     (length-invariant, TRL PR 4891)

then `truncate` clamps w to [ratio_min, ratio_max] (TIS) and `mask` zeroes it outside
(MIS; inside the band it keeps w, or 1 with keep_weight = false: pure rejection).

OPSM (DeepSeek's off-policy sequence masking, in TRL's form) drops sequence i when its
mean advantage is negative and mean over t in i of (log mu(t) - log pi_theta(t)) > opsm_delta,
pi_theta detached: the drift it measures is mismatch plus staleness,
(log mu - log pi_old) + (log pi_old - log pi_theta).

Where pi_old comes from (`loss.old_logprobs`):
- "recompute": the trainer computes pi_old with one no-grad forward before the first
  update, so w is a real mismatch weight and multiplies the PPO surrogate.
- "generator": pi_old is taken to be mu, so c_t = pi_theta / mu (pi_theta detached) and the
  PPO ratio already carries the importance weight. A weight-carrying correction (truncate,
  or mask with keep_weight) then switches the surrogate to REINFORCE with the detached
  truncated/masked ratio (verl's bypass mode, `policy_loss(bypass=True)`), so the ratio is
  applied once; pure rejection (mask, keep_weight = false) keeps the PPO surrogate.
Stale tokens (`rollout.max_staleness >= 1` with "recompute"): pi_old is the trainer's
policy at the update, not the one that generated a token 1..N versions ago, so the PPO ratio
starts at 1 for a stale token as for a fresh one; the staleness lives in pi_old / mu only.
Without a `[correction]` (level "none"), `trainer_correction` therefore weights every token
by w_t = min(pi_old(t) / mu(t), BEHAVIOUR_WEIGHT_CAP), AReaL's decoupled PPO with TIS's cap
(the same as `level = "token", action = "truncate", ratio_min = 0, ratio_max = 2`; geometric
level for gspo). A `[correction]` with a level already builds its weight (or mask) from
pi_old / mu and is used as it is: the weight is never applied twice.
`check_objective` rejects the combinations that have no sound meaning: the ones above, and
GSPO with a token-level weight (GSPO's ratio is one per sequence; with a sequence or
geometric weight, constant over the sequence, its token form and TRL's sequence form give
the same per-token gradients, tests/test_gspo_correction.py).

Shape suffixes: N = loss tokens of this microbatch, S = sequences of the whole step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
from torch import Tensor

from torchtitan_rl.checks import check_range
from torchtitan_rl.losses.policy_loss import LOG_RATIO_CLAMP, LossConfig, masked_max
from torchtitan_rl.reductions import Metric

Level = Literal["none", "token", "sequence", "geometric"]
Action = Literal["truncate", "mask"]
LEVELS = get_args(Level)
ACTIONS = get_args(Action)


@dataclass(kw_only=True, slots=True)
class CorrectionConfig:
    """TOML section [correction]."""

    level: Level = "none"
    """none | token | sequence (product of ratios) | geometric (exp of the mean log-ratio)."""
    action: Action = "truncate"
    """truncate: clamp the weight to [ratio_min, ratio_max] (TIS) | mask: 0 outside it (MIS)."""
    ratio_min: float = 0.0
    """Lower edge of the band, finite and >= 0; 0 leaves it open."""
    ratio_max: float = 2.0
    """Upper edge of the band, > ratio_min; inf leaves it open."""
    keep_weight: bool = True
    """mask only: inside the band use the weight (True) or 1 (False, pure rejection)."""
    opsm_delta: float = 0.0
    """OPSM, finite and >= 0: 0 disables; else drop sequences with mean advantage < 0 and mean
    log(mu / pi_theta) > delta."""

    def validate(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"correction.level must be one of {LEVELS}, got {self.level!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"correction.action must be one of {ACTIONS}, got {self.action!r}")
        check_range("correction.ratio_min", self.ratio_min, ge=0)
        check_range("correction.ratio_max", self.ratio_max, gt=0, allow_inf=True)
        if not self.ratio_min < self.ratio_max:
            raise ValueError(
                f"correction.ratio_min and correction.ratio_max must satisfy "
                f"0 <= ratio_min < ratio_max, got {self.ratio_min} and {self.ratio_max}"
            )
        if not self.keep_weight and self.action != "mask":
            raise ValueError(
                "correction.keep_weight=False only applies to correction.action='mask' "
                f"(truncate always uses the clamped weight), got action={self.action!r}"
            )
        check_range("correction.opsm_delta", self.opsm_delta, ge=0)

    @property
    def enabled(self) -> bool:
        """Whether the trainer builds weights at all (a level, or OPSM)."""
        return self.level != "none" or self.opsm_delta > 0

    @property
    def carries_weight(self) -> bool:
        """Whether the correction multiplies by an importance weight, not only drops tokens."""
        return self.level != "none" and (self.action == "truncate" or self.keep_weight)


BEHAVIOUR_WEIGHT_CAP = 2.0
"""Upper bound of the default staleness weight pi_old / mu (`trainer_correction`): TIS's
C = 2 (Yao et al. 2025; verl's rollout_is_threshold default). A `[correction]` with a level
replaces the default weight, its `ratio_max` the cap."""


def weights_stale_tokens(
    loss: LossConfig, correction: CorrectionConfig, max_staleness: int
) -> bool:
    """Whether the trainer adds the default staleness weight (module docstring): tokens may be
    stale, pi_old is recomputed, and no `[correction]` level says how pi_old / mu enters."""
    return max_staleness >= 1 and loss.old_logprobs == "recompute" and correction.level == "none"


def trainer_correction(
    loss: LossConfig, correction: CorrectionConfig, *, max_staleness: int
) -> CorrectionConfig:
    """The correction the trainer applies: `correction`, or under `weights_stale_tokens` the
    truncated token-level weight min(pi_old / mu, BEHAVIOUR_WEIGHT_CAP) (geometric level for
    gspo, whose ratio is one per sequence), keeping `correction.opsm_delta`.
    Example: max_staleness = 2, no [correction], log pi_old - log mu = [0, 0.3, 1.0] ->
    w = [1, 1.3499, 2] (fresh, 2-stale, 2-stale past the cap)."""
    if not weights_stale_tokens(loss, correction, max_staleness):
        return correction
    level = "geometric" if loss.name == "gspo" else "token"
    return replace(
        correction, level=level, action="truncate", ratio_min=0.0,
        ratio_max=BEHAVIOUR_WEIGHT_CAP, keep_weight=True,
    )  # fmt: skip


BYPASS_LOSSES = ("grpo", "dapo", "dr_grpo")
"""Losses whose surrogate bypass mode may replace: they differ only in aggregation."""


def uses_bypass(loss: LossConfig, correction: CorrectionConfig) -> bool:
    """REINFORCE with the detached corrected ratio pi_theta / mu (see the module docstring)."""
    return loss.old_logprobs == "generator" and correction.carries_weight


def check_objective(loss: LossConfig, correction: CorrectionConfig) -> None:
    """Cross-section rule: ValueError (one line, naming the keys) for a loss and correction
    that would apply the importance ratio twice or have no sound meaning together."""
    if uses_bypass(loss, correction) and loss.name not in BYPASS_LOSSES:
        raise ValueError(
            f"correction.level={correction.level!r} with action={correction.action!r} and "
            f"loss.old_logprobs='generator' replaces the surrogate with REINFORCE on the "
            f"corrected ratio pi/mu, which loss.name={loss.name!r} cannot take (it has its own "
            f"ratio); use loss.old_logprobs='recompute', loss.name in {BYPASS_LOSSES}, or "
            "correction.action='mask' with correction.keep_weight=false"
        )
    if loss.name == "gspo" and correction.level == "token":
        raise ValueError(
            "correction.level='token' with loss.name='gspo': GSPO has one ratio per "
            "sequence, so a weight per token has no single meaning there (TRL spreads each "
            "token's weight over its sequence, the token form keeps it on its token; their "
            "per-token gradients differ); use correction.level='geometric' (length-normalised "
            "like GSPO's ratio) or 'sequence'"
        )


@torch.no_grad()
def correction_weights(
    old_logprobs_N: Tensor,
    generator_logprobs_N: Tensor,
    logprobs_N: Tensor,
    advantages_N: Tensor,
    sequence_ids_N: Tensor,
    *,
    config: CorrectionConfig,
    num_sequences: int,
) -> tuple[Tensor, dict[str, Metric]]:
    """Detached per-token weights for `policy_loss(correction_weights_N=...)`, and metrics.

    Weights come from `old_logprobs_N` (pi_old) against `generator_logprobs_N` (mu); OPSM
    compares `logprobs_N` (pi_theta, detached here) with mu. Tokens where any of the three
    is not finite get weight 0 and are left out of every sequence sum.
    `sequence_ids_N` runs over 0..num_sequences-1; each sequence lies within this call.
    Example: sequence_ids_N = [0, 0, 1], log c = [0.1, -0.3, 0.2], level=sequence ->
    log w = [-0.2, -0.2, 0.2].
    Metrics (level != none) over valid tokens, before the band: `correction/ratio_mean|min|max`
    of w, and `correction/log_ratio/abs_mean|abs_max` of |log w| (here 0.2 and 0.2).
    """
    logprobs_N = logprobs_N.detach()
    valid_N = (
        torch.isfinite(old_logprobs_N)
        & torch.isfinite(generator_logprobs_N)
        & torch.isfinite(logprobs_N)
    )
    log_ratio_N = torch.where(valid_N, old_logprobs_N - generator_logprobs_N, 0.0)
    sequence_ids_N = sequence_ids_N.long()
    valid_f_N = valid_N.to(log_ratio_N.dtype)
    count_S = valid_f_N.new_zeros(num_sequences).index_add(0, sequence_ids_N, valid_f_N)

    def sequence_sum(values_N: Tensor) -> Tensor:
        return torch.zeros_like(count_S).index_add(0, sequence_ids_N, values_N)

    sum_S = sequence_sum(log_ratio_N)
    if config.level == "none":
        log_w_N = torch.zeros_like(log_ratio_N)
    elif config.level == "token":
        log_w_N = log_ratio_N
    elif config.level == "sequence":
        log_w_N = sum_S[sequence_ids_N]
    else:
        log_w_N = (sum_S / count_S.clamp(min=1))[sequence_ids_N]
    weights_N, outside_N = _apply_band(log_w_N, config)

    metrics: dict[str, Metric] = {}
    if config.opsm_delta > 0:
        drift_N = torch.where(valid_N, generator_logprobs_N - logprobs_N, 0.0)
        mean_drift_S = sequence_sum(drift_N) / count_S.clamp(min=1)
        adv_sum_S = sequence_sum(torch.where(valid_N, advantages_N, 0.0))
        dropped_S = (adv_sum_S < 0) & (mean_drift_S > config.opsm_delta) & (count_S > 0)
        weights_N = torch.where(dropped_S[sequence_ids_N], 0.0, weights_N)
        metrics["correction/opsm_dropped_frac"] = Metric.mean(
            dropped_S.sum().to(count_S.dtype), (count_S > 0).sum().to(count_S.dtype)
        )
    weights_N = torch.where(valid_N, weights_N, 0.0)

    if config.level != "none":
        num_valid = valid_f_N.sum()
        ratio_N = torch.exp(log_w_N.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        metrics["correction/ratio_mean"] = Metric.mean(
            torch.where(valid_N, ratio_N, 0.0).sum(), num_valid
        )
        metrics["correction/ratio_min"] = Metric.min(_extreme(ratio_N, valid_N, math.inf))
        metrics["correction/ratio_max"] = Metric.max(_extreme(ratio_N, valid_N, -math.inf))
        # |log w| charts a weight within 1e-6 of 1 readably; TensorBoard's float32 cannot.
        abs_log_w_N = log_w_N.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).abs()
        metrics["correction/log_ratio/abs_mean"] = Metric.mean(
            torch.where(valid_N, abs_log_w_N, 0.0).sum(), num_valid
        )
        metrics["correction/log_ratio/abs_max"] = Metric.max(masked_max(abs_log_w_N, valid_N))
        outside = (outside_N & valid_N).sum().to(num_valid.dtype)
        name = "masked_frac" if config.action == "mask" else "truncated_frac"
        metrics[f"correction/{name}"] = Metric.mean(outside, num_valid)
    return weights_N, metrics


def _apply_band(log_w_N: Tensor, config: CorrectionConfig) -> tuple[Tensor, Tensor]:
    """Weights after truncate/mask, and which tokens fell outside [ratio_min, ratio_max]."""
    if config.level == "none":
        return torch.ones_like(log_w_N), torch.zeros_like(log_w_N, dtype=torch.bool)
    log_min = math.log(config.ratio_min) if config.ratio_min > 0 else -math.inf
    log_max = math.log(config.ratio_max)
    outside_N = (log_w_N < log_min) | (log_w_N > log_max)
    # Clamped before exp: a long sequence's summed log-ratio overflows when ratio_max = inf.
    weight_N = torch.exp(log_w_N.clamp(max=min(log_max, LOG_RATIO_CLAMP)))
    if config.action == "truncate":
        return weight_N.clamp(min=config.ratio_min), outside_N
    inside_N = weight_N if config.keep_weight else torch.ones_like(weight_N)
    return torch.where(outside_N, 0.0, inside_N), outside_N


def _extreme(values_N: Tensor, valid_N: Tensor, fill: float) -> Tensor:
    """min (fill = inf) or max (fill = -inf) over valid tokens, without a host sync; `fill`,
    the identity of that reduction, when there are none."""
    filled_N = torch.cat([torch.where(valid_N, values_N, fill), values_N.new_tensor([fill])])
    return torch.amin(filled_N) if fill > 0 else torch.amax(filled_N)
