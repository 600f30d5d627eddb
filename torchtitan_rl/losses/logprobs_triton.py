"""Triton path of `token_logprobs` for CUDA: exact log-probs, entropies and gradients.

    z_nv = hidden_n . weight_v / temperature,   lse_n = logsumexp_v z_nv
    logprob_n = z_n,target - lse_n,             entropy_n = -sum_v p_nv log p_nv

Forward: one kernel computes logit tiles [BN, BV] with tl.dot (tiles loaded by the Hopper
copy engine where shapes allow) and folds them into per-row online statistics (running max
m, s = sum e^(z-m), u = sum e^(z-m) (z-m)), split over the vocabulary for parallelism; a
few [splits, N] ops combine the splits, and the target logit is one dot product per row.
Nothing of size [N, V] is ever written.

Backward: with a = dL/dlogprob, b = dL/dentropy, the logit gradient is
    g_nv = (a_n [v = target_n] - p_nv (a_n + b_n (log p_nv + H_n))) / temperature.
Per vocabulary chunk of Cv ids a kernel recomputes the logits and writes g [N, Cv] in the
input dtype, then cuBLAS forms grad_weight[chunk] = g^T hidden (complete, K = N) and
grad_hidden += g weight[chunk] (fp32 accumulator). Cv is sized so g stays within
DLOGITS_BUFFER_BYTES. FLOPs: 2NDV forward, 6NDV backward (recompute + two products).

Its timing against the 8NDV floor and the alternatives (a variant that let cuBLAS write
each bf16 logit chunk was slower and rounds logits to bf16): docs/benchmarks.md, "Log-prob
head".

Shape suffixes: N tokens, D hidden size, V vocabulary, S vocabulary splits, C chunk ids.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

DLOGITS_BUFFER_BYTES = 256 * 2**20
"""Size of the [N, Cv] logit-gradient buffer: large enough that each cuBLAS product keeps
the tensor cores busy, small enough to stay well inside a 1 GiB extra-memory budget."""

_NEG_INIT = tl.constexpr(-1.0e30)
"""Initial running max: finite, so (m_old - m_new) * s stays 0 instead of -inf * 0 = NaN."""


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Tile shape of a logit-producing kernel (rows x vocab x hidden step) and its launch."""

    block_n: int = 128
    block_v: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_n: int = 8
    """Row tiles that share a sweep over vocabulary tiles (L2 reuse of weight tiles)."""
    tma: bool = True
    """Load tiles with the Hopper copy engine (tensor descriptors) where shapes allow."""
    maxnreg: int | None = None
    """Register cap per thread: 128 lets two 8-warp programs share an SM, so one's softmax
    can overlap the other's matmul (not faster where tried: docs/benchmarks.md). None: the
    compiler's choice."""


FORWARD_TILES = TileConfig(block_v=256)
"""Fastest of those `bench_logprob.py --tune` tried (docs/benchmarks.md, "Log-prob head")."""
BACKWARD_TILES = TileConfig(block_v=256)
"""Fastest there too, by a hair."""
CHUNK_ALIGN = 256
"""Vocabulary chunks are a multiple of this many ids, so kernel tiles do not straddle them."""


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------
@triton.jit
def _logit_tile(
    h_src, w_src, row0, col0, rows, cols, row_mask, col_mask, D, stride_h, stride_w, inv_temp,
    BN: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """z[BN, BV] = hidden[rows] . weight[cols] / temperature, fp32 accumulation.

    With TMA, h_src / w_src are tensor descriptors (the copy engine zero-fills out-of-range
    rows and columns); otherwise pointers with masked loads.
    """
    acc = tl.zeros([BN, BV], dtype=tl.float32)
    if TMA:
        for k0 in range(0, D, BK):
            h = h_src.load([row0, k0])
            w = w_src.load([col0, k0])
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    else:
        ks = tl.arange(0, BK)
        h_ptrs = h_src + rows[:, None].to(tl.int64) * stride_h + ks[None, :]
        w_ptrs = w_src + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
        for k0 in range(0, D, BK):
            if EVEN_K:
                h = tl.load(h_ptrs, mask=row_mask[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0)
            else:
                k_mask = (k0 + ks) < D
                h = tl.load(h_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
            h_ptrs += BK
            w_ptrs += BK
    return acc * inv_temp


@triton.jit
def _forward_kernel(
    h_ptr, w_ptr, stats_ptr, N, V, D, stride_h, stride_w, inv_temp, tiles_per_split,
    BN: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, WITH_ENTROPY: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Online (m, s, u) of rows [BN] over one split's vocabulary tiles.

    stats_ptr is [3, S, N] fp32: m, s = sum e^(z-m), u = sum e^(z-m) (z-m).
    """
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    rows = pid_n * BN + tl.arange(0, BN)
    row_mask = rows < N
    m = tl.full([BN], _NEG_INIT, dtype=tl.float32)
    s = tl.zeros([BN], dtype=tl.float32)
    u = tl.zeros([BN], dtype=tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(V, BV))
    for tile in range(first, last):
        cols = tile * BV + tl.arange(0, BV)
        col_mask = cols < V
        z = _logit_tile(
            h_ptr, w_ptr, pid_n * BN, tile * BV, rows, cols, row_mask, col_mask, D, stride_h,
            stride_w, inv_temp, BN, BV, BK, EVEN_K, PRECISION, TMA,
        )  # fmt: skip
        z = tl.where(col_mask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        alpha = tl.exp(m - m_new)
        zc = z - m_new[:, None]
        p = tl.exp(zc)
        if WITH_ENTROPY:
            u = alpha * (u + (m - m_new) * s) + tl.sum(p * tl.where(col_mask[None, :], zc, 0.0), 1)
        s = alpha * s + tl.sum(p, 1)
        m = m_new
    plane = num_splits * N
    out = stats_ptr + split * N + rows
    tl.store(out, m, mask=row_mask)
    tl.store(out + plane, s, mask=row_mask)
    tl.store(out + 2 * plane, u, mask=row_mask)


@triton.jit
def _dlogits_math(z, cols, tgt, lse, ent, ga, gb, inv_temp, HAS_GB: tl.constexpr):
    """g = (a [v = target] - p (a + b (log p + H))) / temperature for one tile."""
    logp = z - lse[:, None]
    p = tl.exp(logp)
    if HAS_GB:
        coef = ga[:, None] + gb[:, None] * (logp + ent[:, None])
    else:
        coef = ga[:, None] + tl.zeros_like(logp)
    g = tl.where(cols[None, :] == tgt[:, None], ga[:, None], 0.0) - p * coef
    return g * inv_temp


@triton.jit
def _dlogits_kernel(
    h_ptr, w_ptr, tgt_ptr, lse_ptr, ent_ptr, ga_ptr, gb_ptr, g_ptr,
    N, V, D, v_start, chunk_cols, stride_h, stride_w, stride_g, inv_temp,
    BN: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, HAS_GB: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """g[N, chunk_cols] for vocabulary ids [v_start, v_start + chunk_cols), one tile each."""
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(N, BN)
    col_tiles = tl.cdiv(chunk_cols, BV)
    # Grouped order: GROUP row tiles walk the chunk's columns together, sharing weight tiles.
    per_group = GROUP * col_tiles
    first_row_tile = (pid // per_group) * GROUP
    group_rows = tl.minimum(row_tiles - first_row_tile, GROUP)
    pid_n = first_row_tile + (pid % per_group) % group_rows
    pid_v = (pid % per_group) // group_rows
    rows = pid_n * BN + tl.arange(0, BN)
    local = pid_v * BV + tl.arange(0, BV)
    row_mask = rows < N
    col_mask = local < chunk_cols
    cols = v_start + local
    z = _logit_tile(
        h_ptr, w_ptr, pid_n * BN, v_start + pid_v * BV, rows, cols, row_mask, col_mask, D,
        stride_h, stride_w, inv_temp, BN, BV, BK, EVEN_K, PRECISION, TMA,
    )  # fmt: skip
    tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    ga = tl.load(ga_ptr + rows, mask=row_mask, other=0.0)
    ent = lse
    gb = ga
    if HAS_GB:
        ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
        gb = tl.load(gb_ptr + rows, mask=row_mask, other=0.0)
    g = _dlogits_math(z, cols, tgt, lse, ent, ga, gb, inv_temp, HAS_GB)
    g_ptrs = g_ptr + rows[:, None].to(tl.int64) * stride_g + local[None, :]
    tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# ---------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------
def token_logprobs(
    hidden_ND: Tensor,
    weight_VD: Tensor,
    targets_N: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Same contract as `losses.logprobs.token_logprobs` (dense rows, no support)."""
    outputs = _TritonLogprobs.apply(
        hidden_ND, weight_VD, targets_N, 1.0 / temperature, with_entropy
    )
    if with_entropy:
        return outputs[0], outputs[1]
    return outputs, None


def _for_dtype(tiles: TileConfig, dtype: torch.dtype) -> TileConfig:
    """fp32 operands (exact fp32 products, no tensor cores) take twice the shared memory per
    stage, so halve the hidden step; their copy-engine layouts spill, so use pointer loads."""
    if dtype != torch.float32:
        return tiles
    return replace(tiles, block_k=min(tiles.block_k, 32), tma=False)


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep full fp32 products (like torch's default matmul), others need none."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _sources(hidden_ND: Tensor, weight_VD: Tensor, tiles: TileConfig):
    """(hidden, weight, TMA): tensor descriptors where the copy engine can serve them."""
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
                  for t in (hidden_ND, weight_VD))  # fmt: skip
    on_hopper = hidden_ND.is_cuda and torch.cuda.get_device_capability(hidden_ND.device)[0] >= 9
    if not (tiles.tma and aligned and on_hopper):
        return hidden_ND, weight_VD, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (
        TensorDescriptor.from_tensor(hidden_ND, [tiles.block_n, tiles.block_k]),
        TensorDescriptor.from_tensor(weight_VD, [tiles.block_v, tiles.block_k]),
        True,
    )


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # TRITON_INTERPRET=1 runs the kernels on CPU tensors
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _chunk_cols(n: int, vocab: int, itemsize: int) -> int:
    cols = DLOGITS_BUFFER_BYTES // max(n * itemsize, 1) // CHUNK_ALIGN * CHUNK_ALIGN
    return min(vocab, max(CHUNK_ALIGN, cols))


def _combine(stats_SN: list[Tensor], with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Merge per-split (m, s, u) statistics into (lse_N, entropy_N)."""
    m_SN, s_SN, u_SN = stats_SN
    m_N = m_SN.max(0).values
    scale_SN = torch.exp(m_SN - m_N)
    s_N = (s_SN * scale_SN).sum(0)
    log_s_N = torch.log(s_N)
    lse_N = m_N + log_s_N
    entropy_N = None
    if with_entropy:
        u_N = (scale_SN * (u_SN + (m_SN - m_N) * s_SN)).sum(0)
        entropy_N = log_s_N - u_N / s_N
    return lse_N, entropy_N


def _target_logits(hidden_ND: Tensor, weight_VD: Tensor, targets_N: Tensor, inv_temp: float):
    """z[n, target_n] in fp32, as the kernels accumulate it (outside them: O(N D) work)."""
    acc = torch.promote_types(hidden_ND.dtype, torch.float32)
    w_ND = weight_VD.index_select(0, targets_N)
    return torch.linalg.vecdot(hidden_ND.to(acc), w_ND.to(acc)) * inv_temp


def _forward_stats(hidden_ND, weight_VD, targets_N, inv_temp, with_entropy, tiles):
    """(lse_N, z_target_N, entropy_N or None)."""
    n, d = hidden_ND.shape
    tiles = _for_dtype(tiles, hidden_ND.dtype)
    vocab = weight_VD.shape[0]
    row_tiles = triton.cdiv(n, tiles.block_n)
    vocab_tiles = triton.cdiv(vocab, tiles.block_v)
    # Enough programs for a few waves over the SMs; row tiles of one split run together.
    splits = min(vocab_tiles, triton.cdiv(4 * _num_sms(hidden_ND.device), row_tiles))
    tiles_per_split = triton.cdiv(vocab_tiles, splits)
    splits = triton.cdiv(vocab_tiles, tiles_per_split)
    stats = torch.empty(3, splits, n, dtype=torch.float32, device=hidden_ND.device)
    h_src, w_src, tma = _sources(hidden_ND, weight_VD, tiles)
    _forward_kernel[(row_tiles, splits)](
        h_src, w_src, stats, n, vocab, d,
        hidden_ND.stride(0), weight_VD.stride(0), inv_temp, tiles_per_split,
        BN=tiles.block_n, BV=tiles.block_v, BK=tiles.block_k, EVEN_K=d % tiles.block_k == 0,
        PRECISION=_precision(hidden_ND.dtype), WITH_ENTROPY=with_entropy, TMA=tma,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, maxnreg=tiles.maxnreg,
    )  # fmt: skip
    lse_N, entropy_N = _combine(list(stats), with_entropy)
    return lse_N, _target_logits(hidden_ND, weight_VD, targets_N, inv_temp), entropy_N


def _add_matmul_(acc_ND: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, accumulated and stored in fp32 by cuBLAS (beta = 1 epilogue)."""
    if a.dtype == acc_ND.dtype:
        acc_ND.addmm_(a, b)
        return
    try:
        torch.addmm(acc_ND, a, b, out_dtype=torch.float32, out=acc_ND)
    except RuntimeError:  # builds whose addmm.dtype wants `self` in the input dtype, and CPU
        acc_ND.add_(a @ b)


class _TritonLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, inv_temp, with_entropy):
        hidden_ND, weight_VD = hidden_ND.contiguous(), weight_VD.contiguous()
        targets_N = targets_N.contiguous()
        lse_N, zt_N, entropy_N = _forward_stats(
            hidden_ND, weight_VD, targets_N, inv_temp, with_entropy, FORWARD_TILES
        )
        logprobs_N = zt_N - lse_N
        ctx.save_for_backward(hidden_ND, weight_VD, targets_N, lse_N, entropy_N)
        ctx.inv_temp = inv_temp
        ctx.set_materialize_grads(False)
        if with_entropy:
            return logprobs_N, entropy_N
        return logprobs_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, grad_entropy_N=None):
        hidden_ND, weight_VD, targets_N, lse_N, entropy_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logprobs_N is None and grad_entropy_N is None) or not (need_h or need_w):
            return None, None, None, None, None
        ga_N = (
            torch.zeros_like(lse_N) if grad_logprobs_N is None
            else grad_logprobs_N.float().contiguous()
        )  # fmt: skip
        gb_N = None if grad_entropy_N is None else grad_entropy_N.float().contiguous()
        grad_h, grad_w = _backward(
            hidden_ND, weight_VD, targets_N, lse_N, entropy_N, ga_N, gb_N,
            ctx.inv_temp, need_h, need_w, BACKWARD_TILES,
        )  # fmt: skip
        return grad_h, grad_w, None, None, None


def _backward(
    hidden_ND, weight_VD, targets_N, lse_N, entropy_N, ga_N, gb_N, inv_temp,
    need_h, need_w, tiles,
):  # fmt: skip
    """(grad_hidden, grad_weight), one vocabulary chunk at a time."""
    n, d = hidden_ND.shape
    tiles = _for_dtype(tiles, hidden_ND.dtype)
    vocab = weight_VD.shape[0]
    acc = torch.promote_types(hidden_ND.dtype, torch.float32)
    grad_h = torch.zeros(n, d, dtype=acc, device=hidden_ND.device) if need_h else None
    grad_w = torch.empty_like(weight_VD) if need_w else None
    cols = _chunk_cols(n, vocab, hidden_ND.element_size())
    buffer = torch.empty(n * cols, dtype=hidden_ND.dtype, device=hidden_ND.device)
    has_gb = gb_N is not None
    h_src, w_src, tma = _sources(hidden_ND, weight_VD, tiles)
    for v0 in range(0, vocab, cols):
        w_CD = weight_VD[v0 : v0 + cols]
        c = w_CD.shape[0]
        g_NC = buffer[: n * c].view(n, c)  # contiguous, also for the ragged last chunk
        grid = (triton.cdiv(n, tiles.block_n) * triton.cdiv(c, tiles.block_v),)
        _dlogits_kernel[grid](
            h_src, w_src, targets_N, lse_N, entropy_N if has_gb else lse_N, ga_N,
            gb_N if has_gb else ga_N, g_NC, n, vocab, d, v0, c,
            hidden_ND.stride(0), weight_VD.stride(0), g_NC.stride(0), inv_temp,
            BN=tiles.block_n, BV=tiles.block_v, BK=tiles.block_k, GROUP=tiles.group_n,
            EVEN_K=d % tiles.block_k == 0, PRECISION=_precision(hidden_ND.dtype),
            HAS_GB=has_gb, TMA=tma, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            maxnreg=tiles.maxnreg,
        )  # fmt: skip
        if need_w:
            torch.mm(g_NC.T, hidden_ND, out=grad_w[v0 : v0 + c])
        if need_h:
            _add_matmul_(grad_h, g_NC, w_CD)
    return (grad_h.to(hidden_ND.dtype) if need_h else None), grad_w
