"""A weight buffer as the change from a base buffer: a bitmask of the elements whose bits
differ, plus their new values, in order. Decoding it onto the same base gives the new
buffer bit for bit (elements compare as integers of their width, so -0.0 vs 0.0 and NaN
payloads count as changes like any other bits).

    new_P  = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]   # N = 9 elements
    base_P = [1.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 0.0, 9.0]
    bits_B = [0b1000_0010, 0b0000_0000]       # ceil(N / 8) bytes, element i = bit i % 8
    vals_K = [2.0, 8.0]                       # K = 2 changed elements, new_P's dtype

Bytes on the wire: N / 8 + K * element_size, against N * element_size for the whole buffer:
for bf16 the delta is smaller while fewer than 15/16 of the elements change.
Both sides work in chunks of CHUNK elements, so the temporary masks stay small on any
device (a 0.6B model in bf16 is 596M elements). On CPU the compaction and the bit packing go
through numpy: `np.compress` selects 16M bf16 words in 12 ms where torch's masked select takes
70 ms, and `np.packbits` packs them in 1.3 ms (one thread, 2-core VM); on a GPU torch's own
kernels do it.
"""

from __future__ import annotations

import numpy as np
import torch

CHUNK = 1 << 24
"""Elements per chunk (a multiple of 8): temporaries of ~16 MB per chunk."""
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer dtype per element width: elements compare by their bits."""


PACK = 0x0102040810204080
"""Multiplying 8 bytes of 0/1 (as one int64, element j in byte j) by this sums byte j into
bit 56 + j: the top byte is the 8 flags as one bitmask byte (little-endian hosts)."""
SPREAD, PICK, CARRY = 0x0101010101010101, -0x7FBFDFEFF7FBFDFF, 0x7F7F7F7F7F7F7F7F
"""Unpacking: copy a byte to all 8 bytes (SPREAD), keep bit j in byte j (PICK, the int64
value of 0x8040201008040201), then adding CARRY sets bit 7 of each byte that is not 0."""
ONES = 0x0101010101010101


def mask_bytes(numel: int) -> int:
    """Bytes of the bitmask of `numel` elements."""
    return -(-numel // 8)


def delta_bytes(numel: int, changed: int, element_size: int) -> int:
    """Bytes a delta of `changed` of `numel` elements sends (bitmask plus values)."""
    return mask_bytes(numel) + changed * element_size


def chunks(numel: int) -> int:
    return -(-numel // CHUNK)


def _pack(mask_C: torch.Tensor) -> torch.Tensor:
    """The bitmask bytes of a bool mask (padded to a multiple of 8 elements)."""
    if mask_C.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask_C.numpy(), bitorder="little"))
    m8 = mask_C.view(torch.uint8)
    if m8.numel() % 8:
        m8 = torch.nn.functional.pad(m8, (0, -m8.numel() % 8))
    return ((m8.view(torch.int64) * PACK) >> 56).to(torch.uint8)


def _unpack(bits_B: torch.Tensor, numel: int) -> torch.Tensor:
    """The bool mask of `numel` elements that `bits_B` encodes."""
    if bits_B.device.type == "cpu":
        bits = np.unpackbits(bits_B.numpy(), count=numel, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))
    y = (bits_B.to(torch.int64) * SPREAD) & PICK
    flags = (((y & CARRY) + CARRY) | y) >> 7 & ONES  # 0/1 per byte, no carry between bytes
    return flags.view(torch.uint8)[:numel].view(torch.bool)


def _select(x_C: torch.Tensor, mask_C: torch.Tensor) -> torch.Tensor:
    """The elements of `x_C` where `mask_C`, in order (numpy sees them as integers)."""
    if x_C.device.type != "cpu":
        return x_C[mask_C]
    as_int = _INT[x_C.element_size()]
    return torch.from_numpy(np.compress(mask_C.numpy(), x_C.view(as_int).numpy())).view(x_C.dtype)


def _scatter(out_C: torch.Tensor, mask_C: torch.Tensor, vals: torch.Tensor) -> None:
    """`out_C[mask_C] = vals` in order, in place."""
    if out_C.device.type != "cpu":
        out_C.masked_scatter_(mask_C, vals)
        return
    where = torch.from_numpy(np.flatnonzero(mask_C.numpy()))
    out_C.index_copy_(0, where, vals)


def encode(
    new_P: torch.Tensor, base_P: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bits_B, vals_K, counts_C): which elements of `new_P` differ from `base_P` in their
    bits, their values in `new_P`, and how many of them each chunk of CHUNK elements holds
    (so the receiver needs no count of its own), on `new_P`'s device."""
    assert new_P.shape == base_P.shape and new_P.dtype == base_P.dtype, (new_P, base_P)
    assert new_P.dim() == 1
    numel, as_int = new_P.numel(), _INT[new_P.element_size()]
    bits_B = torch.empty(mask_bytes(numel), dtype=torch.uint8, device=new_P.device)
    vals = []
    for start in range(0, numel, CHUNK):
        new_C, base_C = new_P[start : start + CHUNK], base_P[start : start + CHUNK]
        mask_C = new_C.view(as_int) != base_C.view(as_int)
        vals.append(_select(new_C, mask_C))
        packed = _pack(mask_C)
        bits_B[start // 8 : start // 8 + packed.numel()] = packed
    counts_C = torch.tensor([v.numel() for v in vals], dtype=torch.int64)
    return bits_B, torch.cat(vals) if vals else new_P[:0].clone(), counts_C


def decode(
    base_P: torch.Tensor, bits_B: torch.Tensor, vals_K: torch.Tensor, counts_C: torch.Tensor
) -> torch.Tensor:
    """A new buffer: `base_P` with the marked elements replaced by `vals_K`, in order;
    `base_P` itself is left as it was (the engine may still hold it)."""
    assert bits_B.numel() == mask_bytes(base_P.numel()), (bits_B.numel(), base_P.numel())
    assert counts_C.numel() == chunks(base_P.numel()) and int(counts_C.sum()) == vals_K.numel()
    out_P = base_P.clone()
    used = 0
    for i, k in enumerate(counts_C.tolist()):
        if k:
            out_C = out_P[i * CHUNK : (i + 1) * CHUNK]
            b = bits_B[i * CHUNK // 8 : i * CHUNK // 8 + mask_bytes(out_C.numel())]
            _scatter(out_C, _unpack(b, out_C.numel()), vals_K[used : used + k])
        used += k
    return out_P
