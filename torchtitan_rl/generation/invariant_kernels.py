"""Batch-invariant kernels for CUDA (Triton): each row's result is the same bits whatever
the other rows of the call, their number and its place among them.

cuBLAS picks a matmul algorithm by shape (split-K for few rows: the reduction is cut into
pieces summed in another order), and PyTorch's reductions and scans pick their thread
layout by the number of rows (a row of `torch.cumsum` is scanned by more or fewer threads;
one row alone goes to CUB, which is not even run-to-run deterministic). The generator's
batch-invariant mode on CUDA (`generator.batch_invariant`, generation/model_runner.py)
runs these instead:

- `linear`: `x @ w.T` with one tile configuration for every shape (`BLOCK_M`, `BLOCK_N`,
  `BLOCK_K`, warps, stages fixed; never split-K): an output element is the sum over K in
  tiles of `BLOCK_K`, in order, accumulated in fp32, whatever M; the number of rows is not
  a specialisation key of the compiled kernel;
- `rms_norm`: one program per row, the whole row in one block: a fixed reduction tree per
  row width;
- `row_cumsum`: one program per row walking it in blocks of `SCAN_BLOCK` with a carry.

Each is checked against a float64 reference and for per-row invariance under the Triton
interpreter on CPU (tests/test_invariant_kernels.py). Triton is imported on first use, so
this module imports on any machine.
Shape legend: M = rows, K = reduced width, N = output columns, R = rows, D = row width.
"""

from __future__ import annotations

import functools

import torch

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
"""The one tile of `linear`, whatever the shapes (a row's bits must not depend on M)."""
MATMUL_WARPS, MATMUL_STAGES = 4, 3
SCAN_BLOCK = 1024
"""Elements of a row `row_cumsum` scans at once."""


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def matmul(
        x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        m_ok = offs_m < M
        n_ok = offs_n < N
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k_ok = k0 + offs_k < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
            x_ptrs += BK
            w_ptrs += BK
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def rms_norm(
        x_ptr, w_ptr, out_ptr, stride_xa, stride_xb, B, D, eps, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        a = tl.program_id(0)
        b = tl.program_id(1)
        offs = tl.arange(0, BLOCK_D)
        ok = offs < D
        x_ptrs = x_ptr + a.to(tl.int64) * stride_xa + b * stride_xb + offs
        x = tl.load(x_ptrs, mask=ok, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        # As torch's rms_norm: normalised in fp32, rounded to the input's dtype, then scaled.
        y = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        row = a.to(tl.int64) * B + b
        tl.store(out_ptr + row * D + offs, (y * w).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def row_cumsum(x_ptr, out_ptr, V, stride_x, stride_o, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        carry = tl.sum(tl.zeros([BLOCK], x_ptr.dtype.element_ty), axis=0)
        for start in range(0, V, BLOCK):
            ok = start + offs < V
            x = tl.load(x_ptr + r * stride_x + start + offs, mask=ok, other=0.0)
            c = tl.cumsum(x, axis=0) + carry
            tl.store(out_ptr + r * stride_o + start + offs, c, mask=ok)
            carry = tl.sum(tl.where(offs == BLOCK - 1, c, 0.0), axis=0)

    return matmul, rms_norm, row_cumsum


def linear(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """`F.linear(x_MK, w_NK)` (no bias) in the input's dtype, fp32 accumulation; row m
    of the result depends on row m of `x_MK` and on `w_NK` only."""
    M, K = x_MK.shape
    N = w_NK.shape[0]
    assert w_NK.shape[1] == K and x_MK.dtype == w_NK.dtype, (x_MK.shape, w_NK.shape)
    if x_MK.stride(1) != 1:
        x_MK = x_MK.contiguous()
    assert w_NK.stride(1) == 1, w_NK.stride()
    out_MN = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if M == 0:
        return out_MN
    grid = (-(-M // BLOCK_M), -(-N // BLOCK_N))
    _kernels()[0][grid](
        x_MK, w_NK, out_MN, M, N, K, x_MK.stride(0), w_NK.stride(0), out_MN.stride(0),
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
        # fp32 stays fp32 (the trainer's precision); Triton's default rounds to tf32.
        PRECISION="ieee" if x_MK.dtype == torch.float32 else "tf32",
        num_warps=MATMUL_WARPS, num_stages=MATMUL_STAGES,
    )  # fmt: skip
    return out_MN


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` for an `nn.RMSNorm` over the last dim of a `[A, D]` or `[A, B, D]` tensor
    (the last dim contiguous, the others any stride); a contiguous result."""
    D = x.shape[-1]
    assert tuple(norm.normalized_shape) == (D,) and x.stride(-1) == 1 and x.dim() in (2, 3)
    A, B = x.shape[0], x.shape[1] if x.dim() == 3 else 1
    stride_b = x.stride(1) if x.dim() == 3 else 0
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = max(16, 1 << (D - 1).bit_length())
    _kernels()[1][(A, B)](
        x, norm.weight, out, x.stride(0), stride_b, B, D, eps,
        BLOCK_D=block, num_warps=4 if block <= 1024 else 8,
    )  # fmt: skip
    return out


def row_cumsum(x_RV: torch.Tensor) -> torch.Tensor:
    """`torch.cumsum(x_RV, dim=-1)` with each row scanned alone, in the same order whatever
    the number of rows (fp32 or float64)."""
    R, V = x_RV.shape
    assert x_RV.stride(1) == 1, x_RV.stride()
    out = torch.empty_like(x_RV, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    _kernels()[2][(R,)](x_RV, out, V, x_RV.stride(0), out.stride(0), BLOCK=SCAN_BLOCK)
    return out
