"""Decode attention straight from the paged cache (Triton, CUDA only).

The portable decode path gathers every sequence's blocks into a dense `[Hkv, B, S, D]`
copy before two batched matmuls: the keys/values cross device memory three times. This
kernel reads each cached key/value once: one program per (sequence, key/value head, split)
walks its share of the sequence's block table in tiles of `TILE` positions with an online
softmax, serving the G query heads of its group together. With more than one split (long
contexts, few sequences: more programs to fill the GPU), each split writes its partial sum
with its running max and normaliser and a second small step combines them.

Triton is imported on first use, so this module imports on any machine.
Shape legend: B = sequences, Hq / Hkv = query / key-value heads (G = Hq / Hkv),
R = cache rows (blocks * block_size), N = block-table columns, D = head dim, P = splits.
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
        q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, out_ptr, part_ptr, ml_ptr,
        stride_qb, stride_qh, stride_kh, stride_kr, stride_tb, stride_ob, stride_oh,
        num_cols, scale,
        HQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
        BS: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        pos = tl.load(pos_ptr + b)
        per_split = ((pos + TILE) // TILE + SPLITS - 1) // SPLITS * TILE
        lo = split * per_split
        hi = tl.minimum(lo + per_split, pos + 1)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, TILE)
        g_ok = offs_g < G
        heads = h * G + offs_g
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_ok[:, None],
            other=0.0,
        )
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for start in range(lo, hi, TILE):
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
        if SPLITS == 1:
            tl.store(
                out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                mask=g_ok[:, None],
            )
        else:  # an empty split leaves max -inf and sum 0: it weighs nothing when combined
            row = (b * HQ + heads) * SPLITS + split
            tl.store(part_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None])
            tl.store(ml_ptr + row * 2, m_i, mask=g_ok)
            tl.store(ml_ptr + row * 2 + 1, l_i, mask=g_ok)

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
    splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Attention of one query per sequence (at `pos_B`, keys at positions <= it) over the
    cache rows its block table lists; query head h uses key/value head h // G. `[B, Hq, D]`.
    `tile`, `splits`, `num_warps`, `num_stages` change speed only (up to fp32 rounding)."""
    B, Hq, D = q_BHqD.shape
    Hkv = k_HRD.shape[0]
    G = Hq // Hkv
    assert tile % block_size == 0 and k_HRD.stride(2) == 1 and q_BHqD.stride(2) == 1
    out = torch.empty_like(q_BHqD)
    part_BHPD = ml_BHP2 = out
    if splits > 1:
        part_BHPD = torch.empty(B, Hq, splits, D, dtype=torch.float32, device=q_BHqD.device)
        ml_BHP2 = torch.empty(B, Hq, splits, 2, dtype=torch.float32, device=q_BHqD.device)
    _kernel()[(B, Hkv, splits)](
        q_BHqD, k_HRD, v_HRD, table_BN, pos_B, out, part_BHPD, ml_BHP2,
        q_BHqD.stride(0), q_BHqD.stride(1), k_HRD.stride(0), k_HRD.stride(1),
        table_BN.stride(0), out.stride(0), out.stride(1),
        table_BN.shape[1], scale,
        HQ=Hq, G=G, GP=max(16, 1 << (G - 1).bit_length()), D=D, BS=block_size, TILE=tile,
        # fp32 caches stay fp32 (trainer parity); Triton's default would round to tf32.
        PRECISION="ieee" if q_BHqD.dtype == torch.float32 else "tf32", SPLITS=splits,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits == 1:
        return out
    max_BHP, sum_BHP = ml_BHP2.unbind(-1)
    weight_BHP = torch.exp(max_BHP - max_BHP.amax(dim=-1, keepdim=True))
    total_BHD = (weight_BHP[..., None] * part_BHPD).sum(dim=2)
    return (total_BHD / (weight_BHP * sum_BHP).sum(dim=-1)[..., None]).to(out.dtype)
