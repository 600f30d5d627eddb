"""Weights as one flat buffer plus a layout, so a sync is one message, not one per tensor.

layout = [(name, shape, offset), ...]   # offsets into flat_P, in elements
flat_P = concat(t.flatten() for t in state.values())   # one dtype
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class PackedWeights:
    version: int
    flat_P: torch.Tensor
    layout: list[tuple[str, tuple[int, ...], int]]

    @property
    def nbytes(self) -> int:
        return self.flat_P.numel() * self.flat_P.element_size()


def pack_weights(
    state: dict[str, torch.Tensor], version: int, dtype: torch.dtype = torch.float32
) -> PackedWeights:
    layout, offset = [], 0
    for name, t in state.items():
        layout.append((name, tuple(t.shape), offset))
        offset += t.numel()
    flat_P = torch.empty(offset, dtype=dtype)
    for (_, _, start), t in zip(layout, state.values()):
        flat_P[start : start + t.numel()].copy_(t.reshape(-1))
    return PackedWeights(version=version, flat_P=flat_P, layout=layout)


def unpack_weights(packed: PackedWeights) -> dict[str, torch.Tensor]:
    """Views into packed.flat_P, one per tensor (no copies)."""
    out = {}
    for name, shape, start in packed.layout:
        n = 1
        for s in shape:
            n *= s
        out[name] = packed.flat_P[start : start + n].view(shape)
    return out
