"""GRPO-family policy losses over the loss tokens of one microbatch, chosen by `loss.name`.

Three policies (docs/design.md): pi_theta is being trained, pi_old is the trainer's policy
at the step's first update (with asynchronous steps newer than the sampler), mu is the
generator that sampled. `old_logprobs_N` is pi_old: recomputed
by the trainer (`loss.old_logprobs = "recompute"`) or mu itself ("generator"). Per token t
of sequence i, with r_t = exp(cap(logp_t - old_logp_t)) and advantage A_t:

    grpo / dapo / dr_grpo:  -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)
    gspo:   the same on s_t = sg[s_i] * exp(logp_t - sg[logp_t]), s_i = exp(mean_t log r_t)
    cispo:  -sg[min(r_t, 1 + clip_high)] * A_t * logp_t
    bypass: -A_t * logp_t  (REINFORCE; see below)

The policy term is multiplied by the detached correction weight w_t (`corrections.py`: built
from pi_old / mu, 1 without a correction), then `kl_coef * KL_t - entropy_coef * H_t` is
added (not weighted, as in TRL and verl), and everything is aggregated so that summing the
per-microbatch losses over microbatches and data-parallel ranks gives the step's loss.

Per-token gradient coefficient of the policy term, g_t = d loss_t / d logp_t (before
aggregation), 1[.] the not-clipped indicator of the min above:
    recompute, grpo family:   g_t = -w_t A_t r_t 1[.]   (= -w_t A_t at the first update,
                              where r_t = 1: the mismatch weight pi_old / mu, applied once)
    recompute, asynchronous:  the same, with w_t = min(pi_old / mu, 2) when no [correction]
                              is set (rollout.max_staleness >= 1: AReaL's decoupled PPO,
                              `corrections.trainer_correction`); a token sampled k versions
                              ago carries its staleness in pi_old / mu, not in r_t
    generator, no weight:     g_t = -m_t A_t r_t 1[.], r_t = pi_theta / mu, m_t in {0, 1}
                              (mask with keep_weight = false, OPSM)
    generator, bypass:        g_t = -w_t A_t, w_t the truncated/masked pi_theta / mu
                              (token, sequence or geometric level), detached: verl's bypass
                              mode; the ratio is applied once, by w
    gspo:                     g_t = -w_t A_t s_i 1[.], w_t constant over sequence i
                              (sequence or geometric level; token level is refused), so
                              the same as differentiating s_i through every token (TRL)
    cispo:                    g_t = -w_t A_t sg[min(r_t, 1 + clip_high)]
KL_t with d_t = cap(ref_logp_t - logp_t) (an estimate of KL(pi_theta || ref) from samples):
    k1: -d_t (g = 1) | k2: d_t^2 / 2 (g = -d_t) | k3: exp(d_t) - d_t - 1 (g = 1 - exp(d_t))
cap(x) is x clamped to +-LOG_RATIO_CLAMP (20) in value with d cap(x) / dx = 1 everywhere
(straight-through), so every formula above holds as written past the bound: a token at
log-ratio 20.1 gets the coefficient of one at 20 (-A_t e^20 for grpo, 1 - e^20 for k3),
the gradient is capped there, never cut to 0.

Shape suffixes: N = loss tokens of this microbatch, S = sequences of the whole step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from torchtitan_rl.checks import check_range
from torchtitan_rl.hf_folder import check_hf_folder
from torchtitan_rl.reductions import Metric

LOG_RATIO_CLAMP = 20.0
"""Bound on |log-ratio| before exp: exp(20) ~ 5e8 is finite in fp32, exp(89) is not. It caps
the value only (`capped`): the gradient past it is the gradient at it."""

LossName = Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KlEstimator = Literal["k1", "k2", "k3"]
OldLogprobs = Literal["recompute", "generator"]
AGGREGATIONS = get_args(Aggregation)
KL_ESTIMATORS = get_args(KlEstimator)
OLD_LOGPROBS = get_args(OldLogprobs)
KL_REFERENCE_BASE = "base"
"""`loss.kl_reference` value for the LoRA base model (adapters disabled in the same model)."""


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """TOML section [loss]."""

    name: LossName = "grpo"
    """Policy loss: one of LOSSES (grpo | dapo | dr_grpo | gspo | cispo)."""
    clip_low: float = 0.2
    """Lower clip: ratios below 1 - clip_low stop pushing down (grpo family); in
    [0, 1 - e^-20] (past it the log-ratio cap would let a clipped token push again)."""
    clip_high: float = 0.2
    """Upper clip: ratios above 1 + clip_high stop pushing up, in [0, e^20 - 1); DAPO wants
    more, e.g. 0.28."""
    aggregation: Aggregation = "token_mean"
    """token_mean | seq_mean_token_mean | seq_mean_token_sum; dapo and dr_grpo fix their own."""
    dr_grpo_normalizer: float = 1024.0
    """dr_grpo only: constant per-sequence denominator, in tokens (usually the max length),
    finite and > 0."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss), finite and >= 0; 0 disables."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to a frozen reference policy, finite and >= 0; 0 disables
    (and keeps no reference in memory)."""
    kl_estimator: KlEstimator = "k3"
    """k1: logp - ref | k2: (logp - ref)^2 / 2 | k3: exp(ref - logp) - (ref - logp) - 1
    (non-negative, lower variance)."""
    kl_reference: str = ""
    """Hugging Face folder of the reference policy (config.json and *.safetensors, checked
    when the config loads); "" uses the policy as RL starts (after the warm start); "base"
    (with [lora] on) the base model: the policy's own forward with its adapters disabled,
    no second model. Only with kl_coef > 0."""
    old_logprobs: OldLogprobs = "recompute"
    """pi_old of the PPO ratio: "recompute" (one no-grad trainer forward per step, before the
    first update; with rollout.max_staleness >= 1 and no [correction], each token is weighted
    by min(pi_old / mu, 2)) | "generator" (the generator's log-probs mu; no extra forward)."""

    def validate(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"loss.name must be one of {sorted(LOSSES)}, got {self.name!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"loss.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}"
            )
        fixed = LOSSES[self.name].aggregation
        if fixed is not None and self.aggregation != "token_mean":
            raise ValueError(
                f"loss.aggregation={self.aggregation!r} has no effect with loss.name="
                f"{self.name!r}, which always aggregates as {fixed!r}; leave it at 'token_mean'"
            )
        # the clip decides on the capped ratio: a bound past e^+-20 would let the cap turn a
        # clipped token's gradient back on
        check_range("loss.clip_low", self.clip_low, ge=0, le=1 - math.exp(-LOG_RATIO_CLAMP))
        check_range("loss.clip_high", self.clip_high, ge=0, lt=math.exp(LOG_RATIO_CLAMP) - 1)
        if self.name == "dapo" and self.clip_high <= self.clip_low:
            raise ValueError(
                f"loss.clip_high must exceed loss.clip_low for dapo (e.g. 0.28 vs 0.2), "
                f"got {self.clip_high} <= {self.clip_low}"
            )
        check_range("loss.dr_grpo_normalizer", self.dr_grpo_normalizer, gt=0)
        check_range("loss.entropy_coef", self.entropy_coef, ge=0)
        check_range("loss.kl_coef", self.kl_coef, ge=0)
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(
                f"loss.old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}"
            )
        if self.kl_reference and self.kl_coef == 0:
            raise ValueError(
                f"loss.kl_reference={self.kl_reference!r} is only used with loss.kl_coef > 0"
            )
        if self.kl_reference and self.kl_reference != KL_REFERENCE_BASE:
            check_hf_folder("loss.kl_reference", self.kl_reference, tokenizer=False)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"loss.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )


@dataclass(frozen=True, slots=True)
class _Tokens:
    """Sanitised per-token inputs: every field is finite, 0 where `valid_N` is False."""

    logprobs_N: Tensor
    log_ratio_N: Tensor  # capped to +-LOG_RATIO_CLAMP (value only, see `capped`)
    advantages_N: Tensor
    sequence_ids_N: Tensor
    valid_N: Tensor  # bool
    count_S: Tensor  # valid tokens of each sequence in this microbatch


Surrogate = Callable[[_Tokens, LossConfig], tuple[Tensor, Tensor, Tensor]]
"""(tokens, config) -> (loss_N, log_ratio_N, clipped_N): per-token loss, the detached log of
the ratio the loss uses (a log, so the metrics tell apart ratios within 1e-6 of 1), clip
indicator."""


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    surrogate: Surrogate
    aggregation: str | None
    """Aggregation this loss always uses; None follows loss.aggregation."""


def _clipped(ratio_N: Tensor, advantages_N: Tensor, config: LossConfig) -> tuple[Tensor, Tensor]:
    low, high = 1.0 - config.clip_low, 1.0 + config.clip_high
    surrogate_N = torch.minimum(ratio_N * advantages_N, ratio_N.clamp(low, high) * advantages_N)
    clipped_N = ((advantages_N > 0) & (ratio_N > high)) | ((advantages_N < 0) & (ratio_N < low))
    return -surrogate_N, clipped_N


def _ppo_clip(tokens: _Tokens, config: LossConfig) -> tuple[Tensor, Tensor, Tensor]:
    ratio_N = torch.exp(tokens.log_ratio_N)
    loss_N, clipped_N = _clipped(ratio_N, tokens.advantages_N, config)
    return loss_N, tokens.log_ratio_N.detach(), clipped_N


def _gspo(tokens: _Tokens, config: LossConfig) -> tuple[Tensor, Tensor, Tensor]:
    seq_N = tokens.sequence_ids_N
    sum_S = torch.zeros_like(tokens.count_S).index_add(0, seq_N, tokens.log_ratio_N.detach())
    mean_log_ratio_S = sum_S / tokens.count_S.clamp(min=1)
    logprobs_N = tokens.logprobs_N
    # Value s_i for every token of sequence i; gradient s_i * d logp_t (GSPO's token form).
    ratio_N = torch.exp(mean_log_ratio_S[seq_N] + logprobs_N - logprobs_N.detach())
    loss_N, clipped_N = _clipped(ratio_N, tokens.advantages_N, config)
    return loss_N, mean_log_ratio_S[seq_N], clipped_N


def _cispo(tokens: _Tokens, config: LossConfig) -> tuple[Tensor, Tensor, Tensor]:
    log_ratio_N = tokens.log_ratio_N.detach()
    ratio_N = torch.exp(log_ratio_N)
    weight_N = ratio_N.clamp(max=1.0 + config.clip_high)
    loss_N = -weight_N * tokens.advantages_N * tokens.logprobs_N
    return loss_N, log_ratio_N, ratio_N > 1.0 + config.clip_high


LOSSES: dict[LossName, PolicyLoss] = {
    "grpo": PolicyLoss(surrogate=_ppo_clip, aggregation=None),
    "dapo": PolicyLoss(surrogate=_ppo_clip, aggregation="token_mean"),
    "dr_grpo": PolicyLoss(surrogate=_ppo_clip, aggregation="dr_grpo"),
    "gspo": PolicyLoss(surrogate=_gspo, aggregation=None),
    "cispo": PolicyLoss(surrogate=_cispo, aggregation=None),
}
assert tuple(LOSSES) == get_args(LossName)  # one list of names: the type's


def policy_loss(
    logprobs_N: Tensor,
    old_logprobs_N: Tensor,
    advantages_N: Tensor,
    sequence_ids_N: Tensor,
    *,
    config: LossConfig,
    num_global_tokens: int,
    num_global_sequences: int,
    entropy_N: Tensor | None = None,
    ref_logprobs_N: Tensor | None = None,
    correction_weights_N: Tensor | None = None,
    bypass: bool = False,
) -> tuple[Tensor, dict[str, Metric]]:
    """Loss of this microbatch's share of the step, and detached metrics (module docstring).

    Tokens whose trainer log-prob or pi_old is not finite leave the loss (a non-finite
    generator log-prob should reach here as a non-finite pi_old). `num_global_tokens` counts
    the step's loss tokens with a finite pi_old (the batcher knows those up front); the
    per-sequence counts are taken here. Each sequence lies within one microbatch;
    `sequence_ids_N` runs over 0..num_global_sequences-1. `correction_weights_N` multiplies
    the policy term; `bypass` (generator mode with a weight-carrying correction) makes that
    term -A_t logp_t, the weights being the corrected ratio pi_theta / mu.
    Example: two sequences, tokens [a0 a1 a2 | b0], sequence_ids_N = [0, 0, 0, 1].
    Ratio metrics over valid tokens, r_t the ratio the loss uses (s_i for gspo):
    `loss/ratio_mean` = mean r_t; `loss/log_ratio/abs_mean|abs_max` = mean|max |log r_t|,
    readable where r_t is within 1e-6 of 1 (a chart of r_t there has every tick at 1, and
    TensorBoard's float32 keeps about 7 digits).
    """
    if num_global_tokens < 1 or num_global_sequences < 1:
        raise ValueError(
            f"num_global_tokens and num_global_sequences must be >= 1, got "
            f"{num_global_tokens} and {num_global_sequences}"
        )
    spec = LOSSES[config.name]
    old_finite_N = torch.isfinite(old_logprobs_N)
    valid_N = old_finite_N & torch.isfinite(logprobs_N)
    # torch.where before any arithmetic: a NaN that is multiplied by 0 still poisons gradients.
    tokens = _sanitise(
        logprobs_N, old_logprobs_N, advantages_N, sequence_ids_N, valid_N, num_global_sequences
    )
    if bypass:
        per_token_N = -tokens.advantages_N * tokens.logprobs_N
        log_ratio_N, clipped_N = tokens.log_ratio_N.detach(), None
    else:
        per_token_N, log_ratio_N, clipped_N = spec.surrogate(tokens, config)
    if correction_weights_N is not None:
        per_token_N = per_token_N * _masked(correction_weights_N.detach(), valid_N)
    policy_N = _masked(per_token_N, valid_N)
    total_N = policy_N
    kl_N = None
    if ref_logprobs_N is not None:
        kl_N = _kl(tokens, _masked(ref_logprobs_N.detach(), valid_N), config.kl_estimator)
        total_N = total_N + config.kl_coef * kl_N
    if entropy_N is not None:
        entropy_N = _masked(entropy_N, valid_N)
        total_N = total_N - config.entropy_coef * entropy_N

    def aggregate(values_N: Tensor) -> Tensor:
        return _aggregate(
            values_N, tokens, spec.aggregation or config.aggregation, config,
            num_global_tokens, num_global_sequences,
        )  # fmt: skip

    loss = aggregate(total_N)
    # This microbatch's share of the step: its shares of the loss add up to the step's loss.
    share = old_finite_N.sum().to(log_ratio_N.dtype) / num_global_tokens
    metrics = {
        "loss/mean": Metric.mean(loss.detach(), share),
        "loss/policy": Metric.mean(aggregate(policy_N).detach(), share),
    }
    num_valid = valid_N.sum().to(log_ratio_N.dtype)

    def token_mean(values_N: Tensor) -> Metric:
        values_N = values_N.detach().to(log_ratio_N.dtype)
        return Metric.mean(torch.where(valid_N, values_N, 0.0).sum(), num_valid)

    metrics["loss/ratio_mean"] = token_mean(torch.exp(log_ratio_N))
    metrics["loss/log_ratio/abs_mean"] = token_mean(log_ratio_N.abs())
    metrics["loss/log_ratio/abs_max"] = Metric.max(masked_max(log_ratio_N.abs(), valid_N))
    if clipped_N is not None:
        metrics["loss/clip_frac"] = token_mean(clipped_N)
    if entropy_N is not None:
        metrics["loss/entropy"] = token_mean(entropy_N)
    if kl_N is not None:
        metrics["loss/kl"] = token_mean(kl_N)
    return loss, metrics


def _masked(values_N: Tensor, valid_N: Tensor) -> Tensor:
    return torch.where(valid_N, values_N, 0.0)


def masked_max(values_N: Tensor, valid_N: Tensor) -> Tensor:
    """Max of `values_N` over valid tokens without a host sync; -inf ("nothing seen", left
    out by `reductions.results`) when there are none."""
    filled_N = torch.where(valid_N, values_N, -math.inf)
    return torch.cat([filled_N, values_N.new_tensor([-math.inf])]).amax()


def _sanitise(
    logprobs_N: Tensor,
    old_logprobs_N: Tensor,
    advantages_N: Tensor,
    sequence_ids_N: Tensor,
    valid_N: Tensor,
    num_sequences: int,
) -> _Tokens:
    logprobs_N = _masked(logprobs_N, valid_N)
    old_logprobs_N = _masked(old_logprobs_N.detach(), valid_N)
    log_ratio_N = capped(logprobs_N - old_logprobs_N)
    sequence_ids_N = sequence_ids_N.long()
    valid_f_N = valid_N.to(logprobs_N.dtype)
    count_S = valid_f_N.new_zeros(num_sequences).index_add(0, sequence_ids_N, valid_f_N)
    return _Tokens(
        logprobs_N=logprobs_N,
        log_ratio_N=log_ratio_N,
        advantages_N=_masked(advantages_N, valid_N),
        sequence_ids_N=sequence_ids_N,
        valid_N=valid_N,
        count_S=count_S,
    )


def capped(log_ratio_N: Tensor) -> Tensor:
    """`log_ratio_N` clamped to +-LOG_RATIO_CLAMP in value, with gradient 1 everywhere
    (straight-through): exp of it keeps, past the bound, the gradient it has at the bound.
    The clamped value is exact (x - sg[x] is exactly 0 for finite x); callers pass finite
    values only."""
    return log_ratio_N.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) + (
        log_ratio_N - log_ratio_N.detach()
    )


def _kl(tokens: _Tokens, ref_logprobs_N: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy."""
    log_ref_ratio_N = capped(ref_logprobs_N - tokens.logprobs_N)
    if estimator == "k1":
        kl_N = -log_ref_ratio_N
    elif estimator == "k2":
        kl_N = 0.5 * log_ref_ratio_N.square()
    else:
        kl_N = torch.exp(log_ref_ratio_N) - log_ref_ratio_N - 1.0
    return torch.where(tokens.valid_N, kl_N, 0.0)


def _aggregate(
    values_N: Tensor,
    tokens: _Tokens,
    mode: str,
    config: LossConfig,
    num_global_tokens: int,
    num_global_sequences: int,
) -> Tensor:
    """This microbatch's share of the step-level mean; `values_N` is 0 on invalid tokens."""
    if mode == "token_mean":
        return values_N.sum() / num_global_tokens
    if mode == "dr_grpo":
        return values_N.sum() / (config.dr_grpo_normalizer * num_global_sequences)
    if mode == "seq_mean_token_sum":
        return values_N.sum() / num_global_sequences
    assert mode == "seq_mean_token_mean", mode
    count_N = tokens.count_S[tokens.sequence_ids_N].clamp(min=1)
    return (values_N / count_N).sum() / num_global_sequences
