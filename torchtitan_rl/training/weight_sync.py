"""Weights as one flat buffer plus a layout, so a sync is one message, not one per tensor.

layout = [(name, shape, offset), ...]   # offsets into flat_P, in elements
flat_P = concat(t.flatten() for t in state.values())   # one dtype

Two ways to hand the buffer to a generator (torchtitan_rl/weight_transport.py picks one):
- `PackedWeights`: the buffer itself, on CPU; it travels through the controller (any hosts).
- `SharedWeights`: trainer rank 0 keeps the buffer on its GPU (`SharedBuffer`) and sends
  CUDA IPC handles, a few KB; a generator on the same host opens the buffer once
  (`SharedReader`) and copies it device to device at every sync.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

Layout = list[tuple[str, tuple[int, ...], int]]


@dataclass(kw_only=True, slots=True)
class PackedWeights:
    version: int
    flat_P: torch.Tensor
    layout: Layout

    @property
    def nbytes(self) -> int:
        return self.flat_P.numel() * self.flat_P.element_size()


def make_layout(state: dict[str, torch.Tensor]) -> tuple[Layout, int]:
    """(layout, total elements) of `state` packed in its order; shapes are global shapes
    (a DTensor shard counts as its full tensor)."""
    layout, offset = [], 0
    for name, t in state.items():
        layout.append((name, tuple(t.shape), offset))
        offset += t.numel()
    return layout, offset


def pack_weights(
    state: dict[str, torch.Tensor], version: int, dtype: torch.dtype = torch.float32
) -> PackedWeights:
    layout, numel = make_layout(state)
    flat_P = torch.empty(numel, dtype=dtype)
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


# ---- trainer side: gather on the device ---------------------------------------------------
def sharded_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight as this rank holds it (DTensor shards under FSDP/TP), under the names of
    the full state dict. No communication."""
    return get_model_state_dict(model)


@torch.no_grad()
def gather_into(state: dict[str, torch.Tensor], flat_P: torch.Tensor | None) -> None:
    """Packs the full weights into `flat_P` (in its dtype and on its device, with the
    layout of `make_layout(state)`). A collective under FSDP/TP: every rank must call it,
    and every rank gathers one full tensor at a time (extra memory: the largest tensor);
    only the rank that passes `flat_P` keeps them."""
    layout, _ = make_layout(state)
    for (_, _, start), t in zip(layout, state.values(), strict=True):
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if flat_P is not None:
            flat_P[start : start + full.numel()].copy_(full.reshape(-1))


# ---- CUDA IPC ----------------------------------------------------------------------------
def cuda_uuid(device: torch.device) -> str:
    """The physical GPU's UUID: the same string in every process of the host that sees it."""
    return str(torch.cuda.get_device_properties(device).uuid)


def visible_cuda_uuids() -> list[str]:
    """UUIDs of the GPUs this process can open, by local device index ([] without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [cuda_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]


@dataclass(kw_only=True, slots=True)
class SharedWeights:
    """Version `version` of the weights, left in trainer rank 0's GPU buffer: the layout
    plus one CUDA IPC handle per receiver (a few KB in all; the bytes stay on the GPU).

    handles[i] = {"storage_handle": b"...", "storage_device": 0, "dtype": torch.bfloat16,
                  "tensor_size": torch.Size([n]), ...}
    # keyword arguments of torch.multiprocessing.reductions.rebuild_cuda_tensor; receiver i
    # (generator i) uses handles[i], so each receiver's release is counted once
    """

    version: int
    layout: Layout
    device_uuid: str
    handles: list[dict[str, Any]]


def _share(flat_P: torch.Tensor) -> dict[str, Any]:
    rebuild, args = reduce_tensor(flat_P)
    assert rebuild is rebuild_cuda_tensor, rebuild
    return dict(inspect.signature(rebuild_cuda_tensor).bind(*args).arguments)


class SharedBuffer:
    """Trainer rank 0's packed weights on its GPU: allocated once, refilled at every sync.

    Lifetime: the buffer lives as long as this object, which the trainer actor keeps for the
    whole run. Refilling it is safe because the controller awaits every generator's read
    (`SharedReader.read` returns only after its copy finished) before it calls the trainer
    again.
    """

    def __init__(self, layout: Layout, numel: int, dtype: torch.dtype, device: torch.device):
        self.layout = layout
        self.flat_P = torch.empty(numel, dtype=dtype, device=device)
        self.device_uuid = cuda_uuid(device)
        self._handles: list[dict[str, Any]] = []

    def fits(self, layout: Layout, dtype: torch.dtype) -> bool:
        return layout == self.layout and dtype == self.flat_P.dtype

    def publish(self, version: int, receivers: int) -> SharedWeights:
        """Call after `gather_into(state, self.flat_P)`: waits for the packing to finish
        (receivers read from other processes, outside this process's stream order)."""
        torch.cuda.synchronize(self.flat_P.device)
        while len(self._handles) < receivers:
            self._handles.append(_share(self.flat_P))
        return SharedWeights(
            version=version,
            layout=self.layout,
            device_uuid=self.device_uuid,
            handles=self._handles[:receivers],
        )


class SharedReader:
    """A generator's side: opens the trainer's buffer once (opening a CUDA IPC mapping
    costs far more than the copy) and copies it into memory of its own at each sync."""

    def __init__(self, device: torch.device):
        self.device = device
        self._key: tuple | None = None
        self._src_P: torch.Tensor | None = None

    def read(self, shared: SharedWeights, receiver: int) -> PackedWeights:
        """A copy of the shared buffer on this reader's device; returns after the copy has
        finished, so the trainer may overwrite its buffer from then on."""
        handle = shared.handles[receiver]
        key = (handle["storage_handle"], handle["storage_offset_bytes"])
        if key != self._key:
            uuids = visible_cuda_uuids()
            if shared.device_uuid not in uuids:
                raise ValueError(f"GPU {shared.device_uuid} is not visible here (sees {uuids})")
            # the trainer's device index may differ in this process: name it by UUID
            local = uuids.index(shared.device_uuid)
            self._src_P = rebuild_cuda_tensor(**{**handle, "storage_device": local})
            self._key = key
        src_P = self._src_P
        assert src_P is not None
        flat_P = torch.empty(src_P.shape, dtype=src_P.dtype, device=self.device)
        flat_P.copy_(src_P)
        torch.cuda.synchronize(self.device)
        if src_P.device != self.device:
            torch.cuda.synchronize(src_P.device)
        return PackedWeights(version=shared.version, flat_P=flat_P, layout=shared.layout)

    def close(self) -> None:
        """Unmaps the trainer's buffer (the trainer may free it from then on)."""
        self._key = self._src_P = None
