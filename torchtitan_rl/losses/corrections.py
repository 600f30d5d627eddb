"""Off-policy correction weights: importance ratios of the trainer's policy to the generator's.

Everything runs in log space over the loss tokens, with log r_t = logp_t - generator_logp_t:

    token:      log w_t = log r_t
    sequence:   log w_t = sum over t' in seq(t) of log r_t'      (product of ratios)
    geometric:  log w_t = mean over t' in seq(t) of log r_t'     (length-invariant)

then `truncate` clamps w to [ratio_min, ratio_max] (TIS) or `mask` zeroes it outside (MIS).
OPSM additionally drops a whole sequence whose mean advantage is negative while the policy
has drifted from the generator: mean log r < -opsm_delta. Weights come out detached.

Shape suffixes: N = loss tokens of this microbatch, S = sequences of the whole step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from torchtitan_rl.losses.policy_loss import LOG_RATIO_CLAMP

LEVELS = ("none", "token", "sequence", "geometric")
ACTIONS = ("truncate", "mask")


@dataclass(kw_only=True, slots=True)
class CorrectionConfig:
    """TOML section [correction]."""

    level: str = "none"
    """none | token | sequence (product of ratios) | geometric (exp of the mean log-ratio)."""
    action: str = "truncate"
    """truncate: clamp the weight to [ratio_min, ratio_max] (TIS) | mask: 0 outside it (MIS)."""
    ratio_min: float = 0.0
    """Lower edge of the band, >= 0; 0 leaves it open."""
    ratio_max: float = 2.0
    """Upper edge of the band, > ratio_min; inf leaves it open."""
    keep_weight: bool = True
    """mask only: inside the band use the weight (True) or 1 (False, pure rejection)."""
    opsm_delta: float = 0.0
    """OPSM: 0 disables; else drop sequences with mean advantage < 0 and mean log r < -delta."""

    def validate(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"correction.level must be one of {LEVELS}, got {self.level!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"correction.action must be one of {ACTIONS}, got {self.action!r}")
        if not 0 <= self.ratio_min < self.ratio_max:
            raise ValueError(
                f"correction.ratio_min and correction.ratio_max must satisfy "
                f"0 <= ratio_min < ratio_max, got {self.ratio_min} and {self.ratio_max}"
            )
        if not self.keep_weight and self.action != "mask":
            raise ValueError(
                "correction.keep_weight=False only applies to correction.action='mask' "
                f"(truncate always uses the clamped weight), got action={self.action!r}"
            )
        if not self.opsm_delta >= 0:
            raise ValueError(f"correction.opsm_delta must be >= 0, got {self.opsm_delta}")


@torch.no_grad()
def correction_weights(
    logprobs_N: Tensor,
    generator_logprobs_N: Tensor,
    advantages_N: Tensor,
    sequence_ids_N: Tensor,
    *,
    config: CorrectionConfig,
    num_sequences: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached per-token weights for `policy_loss(correction_weights_N=...)`, and metrics.

    Tokens with a non-finite log-prob get weight 0 and are left out of every sequence sum.
    `sequence_ids_N` runs over 0..num_sequences-1; each sequence lies within this call.
    Example: sequence_ids_N = [0, 0, 1], log r = [0.1, -0.3, 0.2], level=sequence ->
    log w = [-0.2, -0.2, 0.2].
    """
    valid_N = torch.isfinite(logprobs_N) & torch.isfinite(generator_logprobs_N)
    log_ratio_N = torch.where(valid_N, logprobs_N.detach() - generator_logprobs_N, 0.0)
    sequence_ids_N = sequence_ids_N.long()
    valid_f_N = valid_N.to(log_ratio_N.dtype)
    count_S = valid_f_N.new_zeros(num_sequences).index_add(0, sequence_ids_N, valid_f_N)
    sum_S = torch.zeros_like(count_S).index_add(0, sequence_ids_N, log_ratio_N)
    mean_log_ratio_S = sum_S / count_S.clamp(min=1)

    if config.level == "none":
        log_w_N = torch.zeros_like(log_ratio_N)
    elif config.level == "token":
        log_w_N = log_ratio_N
    elif config.level == "sequence":
        log_w_N = sum_S[sequence_ids_N]
    else:
        log_w_N = mean_log_ratio_S[sequence_ids_N]
    weights_N, outside_N = _apply_band(log_w_N, config)

    dropped_S = torch.zeros_like(count_S, dtype=torch.bool)
    if config.opsm_delta > 0:
        adv_sum_S = torch.zeros_like(count_S).index_add(
            0, sequence_ids_N, torch.where(valid_N, advantages_N, 0.0)
        )
        dropped_S = (adv_sum_S < 0) & (mean_log_ratio_S < -config.opsm_delta) & (count_S > 0)
        weights_N = torch.where(dropped_S[sequence_ids_N], 0.0, weights_N)
    weights_N = torch.where(valid_N, weights_N, 0.0)

    num_valid = valid_f_N.sum().clamp(min=1)
    ratio_N = torch.exp(log_w_N.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    outside_frac = (outside_N & valid_N).sum() / num_valid
    zero = torch.zeros((), dtype=ratio_N.dtype, device=ratio_N.device)
    metrics = {
        "correction/ratio_mean": torch.where(valid_N, ratio_N, 0.0).sum() / num_valid,
        "correction/ratio_min": _valid_extreme(ratio_N, valid_N, torch.amin, math.inf),
        "correction/ratio_max": _valid_extreme(ratio_N, valid_N, torch.amax, -math.inf),
        "correction/masked_frac": outside_frac if config.action == "mask" else zero,
        "correction/truncated_frac": outside_frac if config.action == "truncate" else zero,
        "correction/opsm_dropped_frac": dropped_S.sum().to(count_S.dtype)
        / (count_S > 0).sum().clamp(min=1),
    }
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


def _valid_extreme(
    values_N: Tensor, valid_N: Tensor, reduce: Callable[[Tensor], Tensor], fill: float
) -> Tensor:
    """min/max over valid tokens without a host sync; 0 when there are none."""
    if values_N.numel() == 0:
        return values_N.new_zeros(())
    extreme = reduce(torch.where(valid_N, values_N, fill))
    return torch.where(torch.isfinite(extreme), extreme, 0.0)
