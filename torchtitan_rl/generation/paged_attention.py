"""Decode attention straight from the paged cache (Triton, CUDA only).

The portable decode path gathers every sequence's blocks into a dense `[Hkv, B, S, D]`
copy before two batched matmuls: the keys/values cross device memory three times. This
kernel reads each cached key/value once: one program per (sequence, key/value head) walks
the sequence's block table in tiles of `TILE` positions with an online softmax, serving
the G query heads of its group together.

Triton is imported on first use, so this module imports on any machine.
Shape legend: B = sequences, Hq / Hkv = query / key-value heads (G = Hq / Hkv),
R = cache rows (blocks * block_size), N = block-table columns, D = head dim.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, out_ptr,
        stride_qb, stride_qh, stride_kh, stride_kr, stride_tb, stride_ob, stride_oh,
        num_cols, scale,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
        TILE: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + b)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, TILE)
        g_ok = offs_g < G
        q = tl.load(
            q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
            mask=g_ok[:, None],
            other=0.0,
        )
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for start in range(0, pos + 1, TILE):
            tok = start + offs_t
            col = tok // BS
            blk = tl.load(table_ptr + b * stride_tb + col, mask=col < num_cols, other=0)
            rows = blk.to(tl.int64) * BS + tok % BS
            k = tl.load(k_ptr + h * stride_kh + rows[:, None] * stride_kr + offs_d[None, :])
            v = tl.load(v_ptr + h * stride_kh + rows[:, None] * stride_kr + offs_d[None, :])
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            s = tl.where((tok <= pos)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + b * stride_ob + (h * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None],
        )

    return paged_decode


def paged_decode_attention(
    q_BHqD: torch.Tensor,
    k_HRD: torch.Tensor,
    v_HRD: torch.Tensor,
    table_BN: torch.Tensor,
    pos_B: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    tile: int = 64,
) -> torch.Tensor:
    """Attention of one query per sequence (at `pos_B`, keys at positions <= it) over the
    cache rows its block table lists; query head h uses key/value head h // G. `[B, Hq, D]`."""
    B, Hq, D = q_BHqD.shape
    Hkv = k_HRD.shape[0]
    G = Hq // Hkv
    assert tile % block_size == 0 and k_HRD.stride(2) == 1 and q_BHqD.stride(2) == 1
    out = torch.empty_like(q_BHqD)
    _kernel()[(B, Hkv)](
        q_BHqD, k_HRD, v_HRD, table_BN, pos_B, out,
        q_BHqD.stride(0), q_BHqD.stride(1), k_HRD.stride(0), k_HRD.stride(1),
        table_BN.stride(0), out.stride(0), out.stride(1),
        table_BN.shape[1], scale,
        G=G, GP=max(16, 1 << (G - 1).bit_length()), D=D, BS=block_size, TILE=tile,
        # fp32 caches stay fp32 (trainer parity); Triton's default would round to tf32.
        PRECISION="ieee" if q_BHqD.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
