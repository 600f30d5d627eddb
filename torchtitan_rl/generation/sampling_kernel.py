"""Fused sampling of rows that keep the full vocabulary (Triton, CUDA only).

The reference sampler (`sampling.sample_tokens`) writes a `[N, V]` fp32 log-softmax, then a
float64 exp and cumulative sum of it, then searches each row's uniform draw in it: four
full passes over memory that cost more than a decode step's attention for small models at
large batches. For rows with temperature > 0 and no top-k / top-p (the usual RL setting)
this kernel computes the same thing in three reads of the logits and no `[N, V]` writes,
one program per row:

1. max and sum of exp of `logits / temperature` (online, fp32): the row's log-normaliser;
2. total = sum over the vocabulary of exp(float64(log-prob)), log-probs in fp32 as the
   reference computes them;
3. the sampled id: the first whose cumulative float64 probability exceeds `u * total`
   (u the row's uniform draw), clamped to the last id with a non-zero probability (a draw
   rounded up to the total); and its fp32 log-prob.

The cumulative sums add in a different order than the reference's, so a token can differ
only where the draw lies within float64 rounding of a boundary between two tokens.
Triton is imported on first use, so this module imports on any machine.
Shape legend: N = rows, V = vocab.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 2048


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sample_full_vocab(
        logits_ptr, stride, temp_ptr, uniform_ptr, token_ptr, logprob_ptr, V,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0)
        row_ptr = logits_ptr + r.to(tl.int64) * stride
        temp = tl.load(temp_ptr + r)
        offs = tl.arange(0, BLOCK)
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            ok = start + offs < V
            x = tl.load(row_ptr + start + offs, mask=ok, other=float("-inf")) / temp
            new_max = tl.maximum(run_max, x)
            seen = new_max > float("-inf")
            run_sum = tl.where(seen, run_sum * tl.exp(run_max - new_max), 0.0)
            run_sum += tl.where(ok & seen, tl.exp(x - new_max), 0.0)
            run_max = new_max
        row_max = tl.max(run_max, axis=0)
        lanes = run_max > float("-inf")
        log_sum = tl.log(tl.sum(tl.where(lanes, run_sum * tl.exp(run_max - row_max), 0.0)))
        total = tl.zeros([BLOCK], tl.float64)
        for start in range(0, V, BLOCK):
            ok = start + offs < V
            x = tl.load(row_ptr + start + offs, mask=ok, other=float("-inf")) / temp
            logprob = (x - row_max) - log_sum
            total += tl.where(ok, tl.exp(logprob.to(tl.float64)), 0.0)
        target = tl.load(uniform_ptr + r) * tl.sum(total, axis=0)
        below = tl.zeros([], tl.float64)
        token = V
        last = tl.zeros([], tl.int32)
        for start in range(0, V, BLOCK):
            ids = start + offs
            ok = ids < V
            x = tl.load(row_ptr + ids, mask=ok, other=float("-inf")) / temp
            logprob = (x - row_max) - log_sum
            prob = tl.where(ok, tl.exp(logprob.to(tl.float64)), 0.0)
            cdf = below + tl.cumsum(prob, axis=0)
            token = tl.minimum(token, tl.min(tl.where(ok & (cdf > target), ids, V), axis=0))
            last = tl.maximum(last, tl.max(tl.where(prob > 0, ids, 0), axis=0))
            below += tl.sum(prob, axis=0)
        token = tl.minimum(token, last)
        x = tl.load(row_ptr + token) / temp
        tl.store(token_ptr + r, token.to(tl.int64))
        tl.store(logprob_ptr + r, (x - row_max) - log_sum)

    return sample_full_vocab


def sample_full_vocab(
    logits_NV: torch.Tensor, temperature_N: torch.Tensor, uniform_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(token_ids_N int64, logprobs_N fp32)` for rows sampled at `temperature_N` (> 0)
    from the full vocabulary with one float64 uniform draw each (module docstring)."""
    N, V = logits_NV.shape
    assert logits_NV.dtype == torch.float32 and logits_NV.stride(1) == 1
    token_ids_N = torch.empty(N, dtype=torch.long, device=logits_NV.device)
    logprobs_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    _kernel()[(N,)](
        logits_NV, logits_NV.stride(0), temperature_N.float(), uniform_N.double(),
        token_ids_N, logprobs_N, V, BLOCK=BLOCK,
    )  # fmt: skip
    return token_ids_N, logprobs_N
