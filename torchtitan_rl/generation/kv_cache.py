"""Key/value cache for the native engine: one contiguous region per sequence slot.

Every access goes through slot ids and token positions (`write`, `read`) and every
reservation through `SlotAllocator`, so a paged cache (block table + block allocator) can
replace this class without touching the model runner's math.

Shape legend: L = layers, B = sequences in one forward, S = cache positions of one slot,
M = new tokens written in one forward (flattened over sequences), H = key/value heads,
D = head dim.
"""

from __future__ import annotations

import torch


class SlotAllocator:
    """Hands out sequence slots `0 .. num_slots - 1`; the lowest free slot goes first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self._num_slots = num_slots
        self._free: set[int] = set(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def next_free(self) -> int:
        """The slot `allocate` should be given next; ValueError when all are taken."""
        if not self._free:
            raise ValueError(f"all {self._num_slots} slots are in use")
        return min(self._free)

    def allocate(self, slot: int) -> None:
        if slot not in self._free:
            raise ValueError(f"slot {slot} is in use or outside [0, {self._num_slots})")
        self._free.remove(slot)

    def free(self, slot: int) -> None:
        if not 0 <= slot < self._num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.add(slot)


class KVCache:
    """Keys and values of `max_slots` sequences, up to `max_seq_len` tokens each, per layer.

    Layout per layer: `[max_slots, max_seq_len, H, D]` (token-major, as a paged cache
    stores blocks). `lengths[slot]` counts the tokens whose keys/values are stored.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        max_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.allocator = SlotAllocator(max_slots)
        self.lengths = [0] * max_slots
        shape = (max_slots, max_seq_len, num_kv_heads, head_dim)
        self.k_L = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v_L = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]

    def allocate(self) -> int:
        """Reserves the next free slot for a new, empty sequence and returns its id."""
        slot = self.allocator.next_free()
        self.allocator.allocate(slot)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.allocator.free(slot)
        self.lengths[slot] = 0

    def write(
        self,
        layer: int,
        slot_M: torch.Tensor,
        pos_M: torch.Tensor,
        k_MHD: torch.Tensor,
        v_MHD: torch.Tensor,
    ) -> None:
        """Stores one key/value per (slot, position) pair."""
        self.k_L[layer][slot_M, pos_M] = k_MHD.to(self.k_L[layer].dtype)
        self.v_L[layer][slot_M, pos_M] = v_MHD.to(self.v_L[layer].dtype)

    def read(
        self, layer: int, slot_B: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at positions `[0, length)` of each slot, `[B, length, H, D]` each.

        Positions at or past a slot's own length hold stale data; the caller masks them.
        """
        assert 0 < length <= self.max_seq_len, length
        k_BSHD = self.k_L[layer][:, :length].index_select(0, slot_B)
        v_BSHD = self.v_L[layer][:, :length].index_select(0, slot_B)
        return k_BSHD, v_BSHD
