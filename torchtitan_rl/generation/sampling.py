"""Token sampling: temperature, top-k, top-p, keyed random draws, exact log-probs.

Pure functions of fp32 logits. Each row is processed on its own: its support, its
distribution and its random draw never depend on the other rows of the batch, and the only
randomness is one float64 uniform per sampled token, U(seed, position) of
`keyed_random` (the row's seed key and the token's index in its completion), computed on
the logits' device with the same bits on CPU and GPU. So the same seed gives the same token
on CPU and GPU, in any batch, up to fp32 rounding of the log-probs: a draw within ~1e-6 of
a boundary between two tokens may fall either way.

Conventions (also what the trainer replays):
- temperature 0 (greedy): the argmax, log-prob under `log_softmax(logits)` (temperature 1,
  full vocabulary); support is the full vocabulary.
- otherwise: logits / temperature, then top-k keeps the k largest, then top-p keeps the
  smallest set of most likely tokens (of the top-k renormalised distribution) whose mass
  is >= top_p, always at least the top token. The token is drawn from, and its log-prob
  taken under, that distribution renormalised over the kept support.
Ties at a cut-off are broken by lower token id first.

Batch-invariant mode (`sample_tokens(invariant=True)`): every row takes the reference path
(the fused kernel is chosen for a whole batch, and rounds otherwise), and on CUDA the
cumulative sums scan each row alone (`invariant_kernels.row_cumsum`: `torch.cumsum` picks
its threads per row by the number of rows). The other ops already treat each row alone:
sort and gathers are exact, softmax and log-softmax reduce a row in one block whose size
depends on V only, argmax is exact.

Shape legend: N = rows (sequences), V = vocab, K = kept tokens of one row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from torchtitan_rl.device import to_device_async
from torchtitan_rl.generation import invariant_kernels
from torchtitan_rl.generation.keyed_random import keyed_uniform
from torchtitan_rl.generation.sampling_kernel import sample_full_vocab


def as_float32(values) -> np.ndarray:
    """`values` rounded to float32 as `torch.tensor` rounds them (1e-300 -> 0, 1e300 -> inf,
    without numpy's overflow warning)."""
    with np.errstate(over="ignore"):
        return np.asarray(values, dtype=np.float64).astype(np.float32)


@dataclass(kw_only=True, slots=True)
class RowPlan:
    """Which rows sample and which filter (top-k / top-p), known on the host from the rows'
    settings; lets `sample_tokens` run without reading them back from the device, and skip
    what no row needs (an index where every row is in, a top-k or top-p cut no row makes)."""

    sampled_rows: list[int]
    """Rows with temperature > 0 (as the float32 `temperature_N` holds it: a temperature
    that rounds to 0 there is greedy, as the sampler without a plan finds it)."""
    filtered_rows: list[int]
    """Sampled rows with top_k > 0 or top_p < 1."""
    top_k: bool = True
    """Some filtered row keeps only its top k (False: the top-k cut is skipped)."""
    top_p: bool = True
    """Some filtered row has top_p < 1 (False: the nucleus cut is skipped)."""
    sampled_index: torch.Tensor | None = None
    """`sampled_rows` on the logits' device when the caller keeps them there (the engine's
    `SamplingRows`); None: copied there at each call that needs them."""
    filtered_index: torch.Tensor | None = None
    """`filtered_rows` likewise."""

    @classmethod
    def of(cls, temperatures: Sequence[float], top_ps: Sequence[float], top_ks: Sequence[int]):
        """The plan of rows whose settings go to the sampler as float32 tensors (what
        `torch.tensor` makes of Python floats), compared as those tensors hold them."""
        temperatures, top_ps = as_float32(temperatures).tolist(), as_float32(top_ps).tolist()
        sampled = [i for i, t in enumerate(temperatures) if t > 0]
        filtered = [i for i in sampled if top_ks[i] > 0 or top_ps[i] < 1]
        return cls(
            sampled_rows=sampled,
            filtered_rows=filtered,
            top_k=any(top_ks[i] > 0 for i in filtered),
            top_p=any(top_ps[i] < 1 for i in filtered),
        )


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
    keep_NV = _filtered_support(
        logits_NV, temperature_N=temperature_N, top_p_N=top_p_N, top_k_N=top_k_N
    )
    if keep_NV is None:
        return torch.ones(logits_NV.shape, dtype=torch.bool, device=logits_NV.device)
    return keep_NV


Cumsum = Callable[[torch.Tensor], torch.Tensor]
"""A cumulative sum over the last dim of `[R, V]`."""


def _torch_cumsum(x_RV: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x_RV, dim=-1)


def _filtered_support(
    logits_NV: torch.Tensor,
    *,
    temperature_N: torch.Tensor,
    top_p_N: torch.Tensor,
    top_k_N: torch.Tensor,
    plan: RowPlan | None = None,
    cumsum: Cumsum = _torch_cumsum,
) -> torch.Tensor | None:
    """`support_mask`, or None when no row filters (the usual RL setting: the caller can
    skip a full-vocabulary mask that keeps everything). `plan`, when the caller knows the
    rows on the host, saves the device sync of finding them; when every row filters, no
    row is selected or scattered back (the same bits: each row is computed alone)."""
    N, V = logits_NV.shape
    top_k = top_p = True
    if plan is None:
        filtered_N = (temperature_N > 0) & ((top_k_N > 0) | (top_p_N < 1))
        if not bool(filtered_N.any()):
            return None
        rows = filtered_N.nonzero().squeeze(1)
    elif not plan.filtered_rows:
        return None
    else:
        top_k, top_p = plan.top_k, plan.top_p
        rows = plan.filtered_index
        if len(plan.filtered_rows) == N:
            rows = None
        elif rows is None:
            rows = _to_device(plan.filtered_rows, torch.long, logits_NV.device)

    def pick(x):  # the filtered rows of x
        return x if rows is None else x[rows]

    scaled_RV = pick(logits_NV) / pick(temperature_N)[:, None]
    # Stable descending sort puts the lower id first among equal logits.
    sorted_RV, order_RV = torch.sort(scaled_RV, dim=-1, descending=True, stable=True)
    kept_RV = None
    if top_k:
        rank_V = torch.arange(V, device=logits_NV.device)
        top_k_R = pick(top_k_N)
        top_k_R = torch.where(top_k_R > 0, top_k_R, V)
        kept_RV = rank_V[None, :] < top_k_R[:, None]
        sorted_RV = sorted_RV.masked_fill(~kept_RV, float("-inf"))
    probs_RV = torch.softmax(sorted_RV, dim=-1)
    if top_p:
        top_p_R1 = pick(top_p_N)[:, None]
        mass_before_RV = cumsum(probs_RV) - probs_RV
        # top_p == 1 must keep everything, whatever the rounding of the cumulative sum.
        in_nucleus_RV = (mass_before_RV < top_p_R1) | (top_p_R1 >= 1)
        in_nucleus_RV[:, 0] = True
        kept_RV = in_nucleus_RV if kept_RV is None else kept_RV & in_nucleus_RV
    assert kept_RV is not None, "a filtered row cuts by top-k or top-p"
    keep_RV = torch.zeros_like(kept_RV).scatter_(1, order_RV, kept_RV)
    if rows is None:
        return keep_RV
    keep_NV = torch.ones(N, V, dtype=torch.bool, device=logits_NV.device)
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
    logprobs_NV, keep_NV = _sampling_logprobs(
        logits_NV, temperature_N=temperature_N, top_p_N=top_p_N, top_k_N=top_k_N
    )
    if keep_NV is None:
        keep_NV = torch.ones(logits_NV.shape, dtype=torch.bool, device=logits_NV.device)
    return logprobs_NV, keep_NV


def _sampling_logprobs(
    logits_NV: torch.Tensor,
    *,
    temperature_N: torch.Tensor,
    top_p_N: torch.Tensor,
    top_k_N: torch.Tensor,
    plan: RowPlan | None = None,
    cumsum: Cumsum = _torch_cumsum,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sampling_logprobs` with a None mask when every row keeps the full vocabulary."""
    keep_NV = _filtered_support(
        logits_NV,
        temperature_N=temperature_N,
        top_p_N=top_p_N,
        top_k_N=top_k_N,
        plan=plan,
        cumsum=cumsum,
    )
    temp_N = temperature_N  # greedy rows score at temperature 1
    if plan is None or len(plan.sampled_rows) < len(temp_N):
        temp_N = torch.where(temperature_N > 0, temperature_N, torch.ones_like(temperature_N))
    scaled_NV = logits_NV.float() / temp_N[:, None]
    if keep_NV is not None:
        scaled_NV = scaled_NV.masked_fill(~keep_NV, float("-inf"))
    return torch.log_softmax(scaled_NV, dim=-1), keep_NV


def sample_tokens(
    logits_NV: torch.Tensor,
    *,
    temperature_N: torch.Tensor,
    top_p_N: torch.Tensor,
    top_k_N: torch.Tensor,
    key_N: torch.Tensor | None = None,
    position_N: torch.Tensor | None = None,
    uniform_N: torch.Tensor | None = None,
    return_support: bool = False,
    plan: RowPlan | None = None,
    invariant: bool = False,
) -> SampleResult:
    """Samples one token per row (see the module docstring for the conventions).

    Row i draws U(seed, p): `uniform_N[i]` (float64) when the caller has the draws (the
    engine computes them on the host, `keyed_random.host_uniform`), else computed here from
    `key_N[i]` (its seed's key, `keyed_random.seed_keys`) and `position_N[i]` (int64: the
    index of this token in its completion); all on the logits' device; greedy rows ignore
    theirs. With `plan` (the rows' settings as the host knows them) and no
    `return_support`, nothing here waits for the device: the results are tensors still
    being computed, so the caller can queue more work first.
    On CUDA, with `plan`, rows that all sample from the full vocabulary take the fused
    kernel of `sampling_kernel` (the same draws, and the same tokens but within fp32
    rounding of a boundary; no `[N, V]` intermediates). `invariant`: batch-invariant
    mode (module docstring).
    """
    N, V = logits_NV.shape
    draws = (uniform_N,) if uniform_N is not None else (key_N, position_N)
    if any(t is None for t in draws):
        raise ValueError("sample_tokens needs the rows' draws: uniform_N, or key_N and position_N")
    sizes = [t.numel() for t in (temperature_N, top_p_N, top_k_N, *draws)]
    if sizes != [N] * len(sizes):
        raise ValueError(
            f"need one temperature, top_p, top_k and draw (a uniform, or a seed key and a "
            f"position) per row ({N} rows), got {sizes}"
        )
    device = logits_NV.device
    if plan is not None:
        sampled = plan.sampled_rows
    else:
        sampled = [i for i, greedy in enumerate((temperature_N <= 0).tolist()) if not greedy]
    if sampled and uniform_N is None:
        # Every row's draw (a greedy row's is unused): cheaper than selecting.
        uniform_N = keyed_uniform(key_N, position_N)
    cuda = device.type == "cuda"
    cumsum = invariant_kernels.row_cumsum if invariant and cuda else _torch_cumsum
    fused = cuda and logits_NV.dtype == torch.float32 and not return_support and not invariant
    if fused and plan is not None and len(sampled) == N and not plan.filtered_rows:
        token_ids_N, logprobs_N = sample_full_vocab(logits_NV, temperature_N, uniform_N)
        return SampleResult(token_ids_N=token_ids_N, logprobs_N=logprobs_N, support=None)
    logprobs_NV, keep_NV = _sampling_logprobs(
        logits_NV,
        temperature_N=temperature_N,
        top_p_N=top_p_N,
        top_k_N=top_k_N,
        plan=plan,
        cumsum=cumsum,
    )
    if len(sampled) == N:  # no greedy row: skip the argmax and the row selection
        token_ids_N = _inverse_cdf(logprobs_NV, uniform_N, cumsum)
    else:
        token_ids_N = logits_NV.argmax(dim=-1)
        if sampled:
            rows = plan.sampled_index if plan is not None else None
            if rows is None:
                rows = _to_device(sampled, torch.long, device)
            token_ids_N[rows] = _inverse_cdf(logprobs_NV[rows], uniform_N[rows], cumsum)
    logprobs_N = logprobs_NV.gather(1, token_ids_N[:, None]).squeeze(1)
    support = None
    if return_support:
        if keep_NV is None:
            keep_NV = torch.ones(N, V, dtype=torch.bool, device=device)
        # One nonzero over the batch, split per row (ids come out ascending within a row).
        ids_M = keep_NV.nonzero()[:, 1].to(torch.int32)
        support = list(ids_M.split(keep_NV.sum(dim=1).tolist()))
    return SampleResult(token_ids_N=token_ids_N, logprobs_N=logprobs_N, support=support)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device_async(torch.tensor(values, dtype=dtype), device)


def _inverse_cdf(
    logprobs_RV: torch.Tensor, uniform_R: torch.Tensor, cumsum: Cumsum = _torch_cumsum
) -> torch.Tensor:
    """The first token whose cumulative probability exceeds the uniform draw, per row."""
    probs_RV = logprobs_RV.double().exp()
    cdf_RV = cumsum(probs_RV)
    total_R1 = cdf_RV[:, -1:].contiguous()
    ids_R = torch.searchsorted(cdf_RV, uniform_R[:, None] * total_R1, right=True).squeeze(1)
    # A found id's cdf rose there, so it is kept; only a draw rounded up to the total runs
    # past the end (id V). Clamp that to where the cdf reaches its total: the last kept
    # token (one searchsorted instead of a scan of the [R, V] mask).
    last_kept_R = torch.searchsorted(cdf_RV, total_R1, right=False).squeeze(1)
    return torch.minimum(ids_R, last_kept_R)
