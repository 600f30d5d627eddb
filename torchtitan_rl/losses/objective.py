"""The decoupled objective of one microbatch: pi_old, the mismatch correction and the policy
loss put together, as the trainer uses them (and the float64 tests check them).

Inputs per loss token: pi_theta (`logprobs_N`, differentiable), mu (`generator_logprobs_N`,
from the generator), pi_old (`old_logprobs_N`: the trainer's no-grad recompute, or None for
`loss.old_logprobs = "generator"`, which takes pi_old = mu). Which log-prob stands for the
trainer side of the mismatch:
    recompute: pi_old          -> weights from pi_old / mu, PPO ratio pi_theta / pi_old
    generator: pi_theta (sg)   -> weights from pi_theta / mu; a weight-carrying correction
                                  turns the surrogate into REINFORCE (bypass), so the ratio
                                  pi_theta / mu is applied once either way
`correction` is the trainer's (`corrections.trainer_correction`): under asynchronous steps
with "recompute" and no [correction], the truncated token weight min(pi_old / mu, 2).
The per-token gradient coefficients of every mode are in `policy_loss`'s docstring.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchtitan_rl.losses.corrections import CorrectionConfig, correction_weights, uses_bypass
from torchtitan_rl.losses.policy_loss import LossConfig, policy_loss
from torchtitan_rl.reductions import Metric


def microbatch_objective(
    logprobs_N: Tensor,
    old_logprobs_N: Tensor | None,
    generator_logprobs_N: Tensor,
    advantages_N: Tensor,
    sequence_ids_N: Tensor,
    *,
    loss: LossConfig,
    correction: CorrectionConfig,
    num_global_tokens: int,
    num_global_sequences: int,
    entropy_N: Tensor | None = None,
    ref_logprobs_N: Tensor | None = None,
) -> tuple[Tensor, dict[str, Metric]]:
    """This microbatch's share of the step's loss, and its metrics (tensor values).

    A token whose generator log-prob is not finite leaves the loss in every mode (its pi_old
    becomes NaN here). Mismatch metrics compare the trainer side (above) with mu:
    `trainer/logprob_diff/mean|max` = mean|max of |trainer - mu| over finite tokens.
    """
    finite_N = torch.isfinite(generator_logprobs_N)
    if old_logprobs_N is None:
        old_N = generator_logprobs_N
        trainer_N = logprobs_N.detach()
    else:
        old_N = torch.where(finite_N, old_logprobs_N.detach(), generator_logprobs_N)
        trainer_N = old_N
    weights_N, metrics = None, {}
    if correction.enabled:
        weights_N, metrics = correction_weights(
            trainer_N,
            generator_logprobs_N,
            logprobs_N,
            advantages_N,
            sequence_ids_N,
            config=correction,
            num_sequences=num_global_sequences,
        )
    value, loss_metrics = policy_loss(
        logprobs_N,
        old_N,
        advantages_N,
        sequence_ids_N,
        config=loss,
        num_global_tokens=num_global_tokens,
        num_global_sequences=num_global_sequences,
        entropy_N=entropy_N,
        ref_logprobs_N=ref_logprobs_N,
        correction_weights_N=weights_N,
        bypass=uses_bypass(loss, correction),
    )
    metrics.update(loss_metrics)
    gap_N = torch.where(finite_N, (trainer_N - generator_logprobs_N).abs(), 0.0)
    metrics["trainer/logprob_diff/mean"] = Metric.mean(gap_N.sum(), finite_N.sum())
    metrics["trainer/logprob_diff/max"] = Metric.max(torch.cat([gap_N, gap_N.new_zeros(1)]).max())
    metrics["loss/generator_logprob_nan_frac"] = Metric.mean(
        (~finite_N).sum(), float(finite_N.numel())
    )
    return value, metrics
