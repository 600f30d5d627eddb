"""Token sampling: temperature, top-k, top-p, per-row generators, exact log-probs.

Pure functions of fp32 logits. Each row is processed on its own: its support, its
distribution and its random draw never depend on the other rows of the batch, and the only
randomness is one uniform draw per sampled token from the row's own CPU `torch.Generator`
(so the same seed gives the same token on CPU and GPU, in any batch).

Conventions (also what the trainer replays):
- temperature 0 (greedy): the argmax, log-prob under `log_softmax(logits)` (temperature 1,
  full vocabulary); support is the full vocabulary.
- otherwise: logits / temperature, then top-k keeps the k largest, then top-p keeps the
  smallest set of most likely tokens (of the top-k renormalised distribution) whose mass
  is >= top_p, always at least the top token. The token is drawn from, and its log-prob
  taken under, that distribution renormalised over the kept support.
Ties at a cut-off are broken by lower token id first.

Shape legend: N = rows (sequences), V = vocab, K = kept tokens of one row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class SampleResult:
    """What `sample_tokens` returns for a batch of rows."""

    token_ids_N: torch.Tensor
    """Sampled token id per row, int64."""
    logprobs_N: torch.Tensor
    """Log-prob of each sampled id under the distribution it was drawn from, fp32."""
    support: list[torch.Tensor] | None
    """Per row, the kept token ids (int32, ascending) when asked for; else None."""


def support_mask(
    logits_NV: torch.Tensor,
    *,
    temperature_N: torch.Tensor,
    top_p_N: torch.Tensor,
    top_k_N: torch.Tensor,
) -> torch.Tensor:
    """True where a token is kept by top-k then top-p; greedy rows keep every token."""
    N, V = logits_NV.shape
    filtered_N = (temperature_N > 0) & ((top_k_N > 0) | (top_p_N < 1))
    keep_NV = torch.ones(N, V, dtype=torch.bool, device=logits_NV.device)
    if not bool(filtered_N.any()):
        return keep_NV
    rows = filtered_N.nonzero().squeeze(1)
    scaled_RV = logits_NV[rows] / temperature_N[rows, None]
    # Stable descending sort puts the lower id first among equal logits.
    sorted_RV, order_RV = torch.sort(scaled_RV, dim=-1, descending=True, stable=True)
    rank_V = torch.arange(V, device=logits_NV.device)
    top_k_R = torch.where(top_k_N[rows] > 0, top_k_N[rows], V)
    kept_RV = rank_V[None, :] < top_k_R[:, None]
    probs_RV = torch.softmax(sorted_RV.masked_fill(~kept_RV, float("-inf")), dim=-1)
    mass_before_RV = torch.cumsum(probs_RV, dim=-1) - probs_RV
    # top_p == 1 must keep everything, whatever the rounding of the cumulative sum.
    in_nucleus_RV = (mass_before_RV < top_p_N[rows, None]) | (top_p_N[rows, None] >= 1)
    in_nucleus_RV[:, 0] = True
    kept_RV &= in_nucleus_RV
    keep_RV = torch.zeros_like(kept_RV).scatter_(1, order_RV, kept_RV)
    keep_NV[rows] = keep_RV
    return keep_NV


def sampling_logprobs(
    logits_NV: torch.Tensor,
    *,
    temperature_N: torch.Tensor,
    top_p_N: torch.Tensor,
    top_k_N: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the distribution each row samples from (-inf off the support), and the
    support mask: `(logprobs_NV, keep_NV)`."""
    keep_NV = support_mask(logits_NV, temperature_N=temperature_N, top_p_N=top_p_N, top_k_N=top_k_N)
    # Greedy rows score at temperature 1.
    temp_N = torch.where(temperature_N > 0, temperature_N, torch.ones_like(temperature_N))
    scaled_NV = (logits_NV.float() / temp_N[:, None]).masked_fill(~keep_NV, float("-inf"))
    return torch.log_softmax(scaled_NV, dim=-1), keep_NV


def sample_tokens(
    logits_NV: torch.Tensor,
    *,
    temperature_N: torch.Tensor,
    top_p_N: torch.Tensor,
    top_k_N: torch.Tensor,
    generators: Sequence[torch.Generator],
    return_support: bool = False,
) -> SampleResult:
    """Samples one token per row (see the module docstring for the conventions).

    `generators[i]` is row i's CPU generator; it is advanced by one draw for every sampled
    (non-greedy) row and left alone for greedy rows.
    """
    N, V = logits_NV.shape
    if not len(generators) == temperature_N.numel() == top_p_N.numel() == top_k_N.numel() == N:
        raise ValueError(
            f"need one temperature, top_p, top_k and generator per row ({N} rows), got "
            f"{temperature_N.numel()}, {top_p_N.numel()}, {top_k_N.numel()}, {len(generators)}"
        )
    logprobs_NV, keep_NV = sampling_logprobs(
        logits_NV, temperature_N=temperature_N, top_p_N=top_p_N, top_k_N=top_k_N
    )
    token_ids_N = logits_NV.argmax(dim=-1)
    sampled = [i for i, greedy in enumerate((temperature_N <= 0).tolist()) if not greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits_NV.device)
        uniform_R = torch.stack(
            [torch.rand((), generator=generators[i], dtype=torch.float64) for i in sampled]
        ).to(logits_NV.device)
        token_ids_N[rows] = _inverse_cdf(logprobs_NV[rows], uniform_R)
    logprobs_N = logprobs_NV.gather(1, token_ids_N[:, None]).squeeze(1)
    support = None
    if return_support:
        support = [row.nonzero().squeeze(1).to(torch.int32) for row in keep_NV]
    return SampleResult(token_ids_N=token_ids_N, logprobs_N=logprobs_N, support=support)


def _inverse_cdf(logprobs_RV: torch.Tensor, uniform_R: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds the uniform draw, per row."""
    probs_RV = logprobs_RV.double().exp()
    cdf_RV = torch.cumsum(probs_RV, dim=-1)
    target_R1 = (uniform_R * cdf_RV[:, -1])[:, None]
    ids_R = torch.searchsorted(cdf_RV, target_R1, right=True).squeeze(1)
    # Rounding can push the draw past the last kept token; clamp to it.
    V = probs_RV.shape[1]
    last_kept_R = V - 1 - (probs_RV > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.minimum(ids_R, last_kept_R)
