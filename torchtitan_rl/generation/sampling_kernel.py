"""Fused sampling of rows that keep the full vocabulary (Triton, CUDA only).

The reference sampler (`sampling.sample_tokens`) writes a `[N, V]` fp32 log-softmax, then a
float64 exp and cumulative sum of it, then searches each row's uniform draw in it: four
full passes over memory that cost more than a decode step's attention for small models at
large batches. For rows with temperature > 0 and no top-k / top-p (the usual RL setting)
three small kernels compute the same thing in two reads of the logits (and a slice) and
no `[N, V]` writes. Each row is cut into chunks of `CHUNK` ids, one program per (row,
chunk) for the first two:

1. per chunk, max and sum of exp of `logits / temperature` (online, fp32); a tiny kernel
   combines them into the row's log-normaliser;
2. per chunk, its mass: the sum of exp(float64(log-prob)), log-probs in fp32 as the
   reference computes them;
3. per row: total = the sum of its chunks' masses, target = u * total (u the row's
   uniform draw); the chunk where the cumulative mass passes the target, then within it
   the first id whose cumulative float64 probability exceeds the target, clamped to the
   chunk's last id with a non-zero probability (a draw within rounding of the end); and
   the id's fp32 log-prob.

The log-normaliser is combined from chunks (online max and sum in fp32), so a log-prob
may differ from `torch.log_softmax`'s by fp32 rounding, and the cumulative sums add in
another order. A token can therefore differ from the reference's only where the draw lies
within about 1e-6 (relative) of a boundary between two tokens (how often: docs/benchmarks.md,
"Decode").
`tests/test_sampling_kernel.py` runs the kernels under the Triton interpreter.
Triton is imported on first use, so this module imports on any machine.
Shape legend: N = rows, V = vocab.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 2048
CHUNK = 4 * BLOCK


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def row_norm(stats_ptr, norm_ptr, C, CP: tl.constexpr):
        """The row's max and log of its sum of exp (relative to the max), from its chunks."""
        r = tl.program_id(0)
        offs = tl.arange(0, CP)
        ok = offs < C
        chunk_max = tl.load(stats_ptr + (r * C + offs) * 2, mask=ok, other=float("-inf"))
        chunk_sum = tl.load(stats_ptr + (r * C + offs) * 2 + 1, mask=ok, other=0.0)
        row_max = tl.max(chunk_max, axis=0)
        seen = chunk_max > float("-inf")
        total = tl.sum(tl.where(seen, chunk_sum * tl.exp(chunk_max - row_max), 0.0), axis=0)
        tl.store(norm_ptr + r * 2, row_max)
        tl.store(norm_ptr + r * 2 + 1, tl.log(total))

    @triton.jit
    def chunk_stats(
        logits_ptr, stride, temp_ptr, stats_ptr, V, C,
        BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0)
        c = tl.program_id(1)
        row_ptr = logits_ptr + r.to(tl.int64) * stride
        temp = tl.load(temp_ptr + r)
        offs = tl.arange(0, BLOCK)
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
            ok = start + offs < V
            x = tl.load(row_ptr + start + offs, mask=ok, other=float("-inf")) / temp
            new_max = tl.maximum(run_max, x)
            seen = new_max > float("-inf")
            run_sum = tl.where(seen, run_sum * tl.exp(run_max - new_max), 0.0)
            run_sum += tl.where(ok & seen, tl.exp(x - new_max), 0.0)
            run_max = new_max
        chunk_max = tl.max(run_max, axis=0)
        lanes = run_max > float("-inf")
        chunk_sum = tl.sum(tl.where(lanes, run_sum * tl.exp(run_max - chunk_max), 0.0), axis=0)
        tl.store(stats_ptr + (r * C + c) * 2, chunk_max)
        tl.store(stats_ptr + (r * C + c) * 2 + 1, chunk_sum)

    @triton.jit
    def chunk_mass(
        logits_ptr, stride, temp_ptr, norm_ptr, mass_ptr, V, C,
        BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0)
        c = tl.program_id(1)
        row_ptr = logits_ptr + r.to(tl.int64) * stride
        temp = tl.load(temp_ptr + r)
        row_max = tl.load(norm_ptr + r * 2)
        log_sum = tl.load(norm_ptr + r * 2 + 1)
        offs = tl.arange(0, BLOCK)
        mass = tl.zeros([BLOCK], tl.float64)
        for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
            ok = start + offs < V
            x = tl.load(row_ptr + start + offs, mask=ok, other=float("-inf")) / temp
            mass += tl.where(ok, tl.exp(((x - row_max) - log_sum).to(tl.float64)), 0.0)
        tl.store(mass_ptr + r * C + c, tl.sum(mass, axis=0))

    @triton.jit
    def pick(
        logits_ptr, stride, temp_ptr, uniform_ptr, norm_ptr, mass_ptr, token_ptr,
        logprob_ptr, V, C,
        BLOCK: tl.constexpr, CHUNK: tl.constexpr, CP: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0)
        row_ptr = logits_ptr + r.to(tl.int64) * stride
        temp = tl.load(temp_ptr + r)
        row_max = tl.load(norm_ptr + r * 2)
        log_sum = tl.load(norm_ptr + r * 2 + 1)
        chunks = tl.arange(0, CP)
        mass = tl.load(mass_ptr + r * C + chunks, mask=chunks < C, other=0.0)
        target = tl.load(uniform_ptr + r) * tl.sum(mass, axis=0)
        passed = tl.cumsum(mass, axis=0) > target
        last_chunk = tl.max(tl.where(mass > 0, chunks, 0), axis=0)
        chunk = tl.minimum(tl.min(tl.where(passed, chunks, C), axis=0), last_chunk)
        below = tl.sum(tl.where(chunks < chunk, mass, 0.0), axis=0)
        offs = tl.arange(0, BLOCK)
        token = V
        last = tl.zeros([], tl.int32)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            ids = start + offs
            ok = ids < V
            x = tl.load(row_ptr + ids, mask=ok, other=float("-inf")) / temp
            prob = tl.where(ok, tl.exp(((x - row_max) - log_sum).to(tl.float64)), 0.0)
            cdf = below + tl.cumsum(prob, axis=0)
            token = tl.minimum(token, tl.min(tl.where(ok & (cdf > target), ids, V), axis=0))
            last = tl.maximum(last, tl.max(tl.where(prob > 0, ids, 0), axis=0))
            below += tl.sum(prob, axis=0)
        token = tl.minimum(token, last)
        x = tl.load(row_ptr + token) / temp
        tl.store(token_ptr + r, token.to(tl.int64))
        tl.store(logprob_ptr + r, (x - row_max) - log_sum)

    return chunk_stats, row_norm, chunk_mass, pick


def sample_full_vocab(
    logits_NV: torch.Tensor, temperature_N: torch.Tensor, uniform_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(token_ids_N int64, logprobs_N fp32)` for rows sampled at `temperature_N` (> 0)
    from the full vocabulary with one float64 uniform draw each (module docstring)."""
    N, V = logits_NV.shape
    assert logits_NV.dtype == torch.float32 and logits_NV.stride(1) == 1
    device = logits_NV.device
    C = -(-V // CHUNK)
    CP = max(2, 1 << (C - 1).bit_length())
    stats_NC2 = torch.empty(N, C, 2, dtype=torch.float32, device=device)
    mass_NC = torch.empty(N, C, dtype=torch.float64, device=device)
    token_ids_N = torch.empty(N, dtype=torch.long, device=device)
    logprobs_N = torch.empty(N, dtype=torch.float32, device=device)
    temperature_N = temperature_N.float()
    norm_N2 = torch.empty(N, 2, dtype=torch.float32, device=device)
    chunk_stats, row_norm, chunk_mass, pick = _kernels()
    stride = logits_NV.stride(0)
    chunk_stats[(N, C)](logits_NV, stride, temperature_N, stats_NC2, V, C, BLOCK=BLOCK, CHUNK=CHUNK)
    row_norm[(N,)](stats_NC2, norm_N2, C, CP=CP)
    chunk_mass[(N, C)](
        logits_NV, stride, temperature_N, norm_N2, mass_NC, V, C, BLOCK=BLOCK, CHUNK=CHUNK
    )
    pick[(N,)](
        logits_NV, stride, temperature_N, uniform_N.double(), norm_N2, mass_NC,
        token_ids_N, logprobs_N, V, C, BLOCK=BLOCK, CHUNK=CHUNK, CP=CP,
    )  # fmt: skip
    return token_ids_N, logprobs_N
