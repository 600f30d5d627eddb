"""Weights as one flat buffer plus a layout, so a sync is one message, not one per tensor.

layout = [(name, shape, offset), ...]   # offsets into flat_P, in elements
flat_P = concat(t.flatten() for each distinct tensor of state)   # one dtype

A tensor under two names (a tied weight: Qwen3's `tok_embeddings.weight` is
`output.weight`) is packed once; both entries carry the same offset, e.g. for an embedding
E [V, D] and a norm N [D]:
    layout = [("tok_embeddings.weight", (V, D), 0), ("norm.weight", (D,), V*D),
              ("output.weight", (V, D), 0)]          # flat_P.numel() == V*D + D
and `unpack_weights` returns two views of the same memory.

Two ways to hand the buffer to a generator (weight_sync/transport.py picks one):
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
from torch.distributed.tensor import DTensor, Shard
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


def _alias_key(t: torch.Tensor) -> tuple | None:
    """Equal keys = the same weight under two names: the same view of the same local memory
    (`model.state_dict()` detaches each entry, so identity alone misses them). None (alias
    by identity only) for a shard of a multi-rank mesh, where ranks must agree on aliases
    without comparing notes and an empty shard may have no address, and for a tensor
    without memory."""
    if not _is_whole(t):
        return None
    local = _local(t)
    ptr = local.untyped_storage().data_ptr()
    if ptr == 0:
        return None
    shape = (tuple(t.shape), tuple(local.shape), local.stride(), local.storage_offset())
    return (local.device, local.dtype, ptr, *shape)


@torch.no_grad()  # DTensor.to_local is an autograd op otherwise, 5 us per tensor
def _plan(state: dict[str, torch.Tensor]) -> tuple[Layout, int, list[str]]:
    """(layout, total elements, names that own their bytes: the first name of each tensor).

    Under a multi-rank mesh every rank must find the same aliases (they skip the same
    gathers), so shards alias by identity only: `sharded_state` gives tied names one
    parameter object on every rank. A state whose tied names are separate DTensor objects
    is packed with both copies, the same way on every rank."""
    layout, owners, offset = [], [], 0
    first: dict[object, int] = {}
    for name, t in state.items():
        keys = [id(t), _alias_key(t)]
        seen = [first[k] for k in keys if k in first]
        if seen:
            layout.append((name, tuple(t.shape), seen[0]))
            continue
        first.update((k, offset) for k in keys if k is not None)
        layout.append((name, tuple(t.shape), offset))
        owners.append(name)
        offset += t.numel()
    return layout, offset, owners


def make_layout(state: dict[str, torch.Tensor]) -> tuple[Layout, int]:
    """(layout, total elements) of `state` packed in its order, each distinct tensor once;
    shapes are global shapes (a DTensor shard counts as its full tensor)."""
    layout, numel, _ = _plan(state)
    return layout, numel


def pack_weights(
    state: dict[str, torch.Tensor], version: int, dtype: torch.dtype = torch.float32
) -> PackedWeights:
    """The full weights of `state` as one CPU buffer in `dtype`. A collective when `state`
    holds shards of a multi-rank mesh (see `gather_into`): the other ranks call
    `gather_into(state, None)` meanwhile."""
    layout, numel = make_layout(state)
    # Pageable memory, exact size, filled straight from the weights: no second model on the GPU and
    # no pinned block that torch's host allocator would round up and keep for the run. From
    # a GPU this copy is slower, but this path is the fallback there: same-host syncs go
    # through `SharedBuffer`.
    out_P = torch.empty(numel, dtype=dtype)
    gather_into(state, out_P)
    return PackedWeights(version=version, flat_P=out_P, layout=layout)


def unpack_weights(packed: PackedWeights) -> dict[str, torch.Tensor]:
    """Views into packed.flat_P, one per name (no copies; tied names share memory)."""
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
    the full state dict: the parameters themselves (read them under no_grad). No
    communication.

    `model.state_dict` rather than `get_model_state_dict`: the same tensors under the same
    names for our models (no wrapper modules: `apply_compile` swaps `forward` in place), and
    much faster (docs/benchmarks.md, "Weight sync"); FSDP's pre-save hook still
    hands back shards when the root was left unsharded after a forward. A wrapper module
    would show in the names, and the generator rejects unknown names.
    """
    return model.state_dict(keep_vars=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _is_whole(t: torch.Tensor) -> bool:
    """True when this rank's tensor is the full one: a plain tensor, or a DTensor on a
    one-rank mesh. The same answer on every rank (mesh sizes are global)."""
    return not isinstance(t, DTensor) or t.device_mesh.size() == 1


@torch.no_grad()
def gather_into(state: dict[str, torch.Tensor], flat_P: torch.Tensor | None) -> None:
    """Packs the full weights into `flat_P` (in its dtype and on its device, with the
    layout of `make_layout(state)`).

    Whole tensors (`_is_whole`: one trainer rank) need no communication and are packed by
    one batched `_foreach_copy_` (dtype conversion included) instead of one copy per
    tensor. Shards of a multi-rank mesh make this a collective: every rank must call it,
    and every rank gathers one full tensor at a time, in layout order (extra memory: the
    largest tensor); only the rank that passes `flat_P` keeps them.
    """
    _, numel, owners = _plan(state)
    slots: dict[str, torch.Tensor] = {}
    if flat_P is not None:
        assert flat_P.shape == (numel,), (flat_P.shape, numel)
        # owners hold consecutive offsets (aliases take none), so one split gives every slot
        sizes = [state[name].numel() for name in owners]
        slots = {name: s.view(state[name].shape) for name, s in zip(owners, flat_P.split(sizes))}
    whole = [name for name in owners if _is_whole(state[name])]
    if flat_P is not None and whole:
        torch._foreach_copy_([slots[n] for n in whole], [_local(state[n]) for n in whole])
    for name in owners:
        t = state[name]
        if _is_whole(t):
            continue
        full = _gather_rows(t) if _row_sharded(t) else t.full_tensor()
        if flat_P is not None:
            slots[name].copy_(full)


def _row_sharded(t: DTensor) -> bool:
    """FSDP's layout: rows split over a one-dimensional mesh (`Shard(0)`, not a strided
    shard), which `_gather_rows` gathers."""
    return t.device_mesh.ndim == 1 and type(t.placements[0]) is Shard and t.placements[0].dim == 0


@torch.no_grad()
def _gather_rows(t: DTensor) -> torch.Tensor:
    """`t.full_tensor()` for a row-sharded DTensor, through one blocking c10d all-gather.

    DTensor's own path (an asynchronous functional collective, then `wait_tensor`) crashed
    trainers over gloo twice on busy many-core hosts, once in ~3,500 and once in ~4,200
    steps (`malloc(): mismatching next->prev_size`; SIGSEGV in `wait_tensor`), both times
    here. On a 16-core host, 2-rank loops of that path faulted in 5 of 25 runs of 400
    publishes (heap corruption, or both ranks hung in `wait_tensor`); this gather ran 34 such
    runs clean (`scripts/stress_weight_gather.py`; docs/results.md). Rank r holds
    rows [r * c, (r + 1) * c) of ceil(n / world) = c-row chunks (fewer, or none, at the end),
    so each rank pads its rows to c, and the gathered [world * c, ...] keeps the first n.
    """
    mesh = t.device_mesh
    world = mesh.size()
    rows = t.shape[0]
    chunk = -(-rows // world)
    local = t.to_local()
    padded = local.new_zeros((chunk, *t.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    out = local.new_empty((world * chunk, *t.shape[1:]))
    # torch 2.13 renamed it all_gather_single (the old name warns); 2.11 has only the old
    gather = getattr(torch.distributed, "all_gather_single", None)
    (gather or torch.distributed.all_gather_into_tensor)(out, padded, group=mesh.get_group())
    return out[:rows]


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
