"""The broadcast group of weight_sync/broadcast.py, sending only the elements that changed
since the version every member already holds (delta_codec.py: a bitmask plus the values).

Each side keeps the last buffer it sent or received (its base) and the id of that send. A
send id is unique to one send of one trainer process (a random 48-bit start, then +1), so
two bases agree exactly when they are the same bytes. One sync, every member at once:

    1. all-reduce MAX of [base_id, -base_id] (-1 without a base): every member learns the
       largest and the smallest id, so all of them agree iff max == min == rank 0's id
    2. rank 0 broadcasts the header [version, send_id, mode, changed]: mode DELTA when all
       agree and the delta is the smaller message, else FULL
    3. FULL: the packed buffer; DELTA: per-chunk counts, the bitmask, the changed values
    4. every member's base becomes this version, under send_id

So a fresh or restarted replica (no base), or one that missed a sync while it was out of
the group (another id), makes that sync a full one for the whole group, and the next is a
delta again. A sender or receiver that replaces one of its own (a new group after the set
of generators changed) takes over its base, so a survivor keeps receiving deltas.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from torchtitan_rl.weight_sync import delta_codec
from torchtitan_rl.weight_sync.broadcast import (
    BroadcastGroup,
    BroadcastReceiver,
    BroadcastSender,
    _broadcast,
)
from torchtitan_rl.weight_sync.packing import Layout, PackedWeights

FULL, DELTA = 0, 1
NO_BASE = -1


def _agree(pg: dist.ProcessGroup, base_id: int, device: torch.device) -> tuple[int, int]:
    """(largest, smallest) base id over the group."""
    ids = torch.tensor([base_id, -base_id], dtype=torch.int64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([ids], opts).wait()
    return int(ids[0]), -int(ids[1])


class DeltaSender(BroadcastSender):
    """Trainer rank 0's side: `flat_P` is packed by the caller, `base_P` is the last
    version sent (both on the group's device)."""

    def __init__(
        self, layout: Layout, numel: int, dtype: torch.dtype, receivers: int,
        device: torch.device | None = None, previous: object = None,
    ):  # fmt: skip
        super().__init__(layout, numel, dtype, receivers, device)
        self.base_P: torch.Tensor | None = None
        self.base_id = NO_BASE
        self.next_id = int.from_bytes(os.urandom(6), "little")
        self.last: dict[str, int] = {}
        """What the last send did: {"mode", "changed", "bytes"} (benchmarks, tests)."""
        if isinstance(previous, DeltaSender) and self._same_shape(previous):
            self.base_P, self.base_id, self.next_id = (
                previous.base_P,
                previous.base_id,
                previous.next_id,
            )

    def _same_shape(self, other: DeltaSender) -> bool:
        g = other.group
        return (g.layout, g.dtype, other.device) == (
            self.group.layout,
            self.group.dtype,
            self.device,
        )

    def send(self, version: int) -> None:
        assert self._pg is not None, "form the group first"
        send_id, self.next_id = self.next_id, self.next_id + 1
        high, low = _agree(self._pg, self.base_id, self.device)
        mode, changed, body = FULL, self.flat_P.numel(), [self.flat_P]
        if high == low == self.base_id != NO_BASE:
            bits_B, vals_K, counts_C = delta_codec.encode(self.flat_P, self.base_P)
            if delta_codec.delta_bytes(changed, vals_K.numel(), vals_K.element_size()) < (
                self.flat_P.numel() * self.flat_P.element_size()
            ):
                mode, changed = DELTA, vals_K.numel()
                body = [counts_C, bits_B, vals_K][: 3 if changed else 2]
        header = torch.tensor([version, send_id, mode, changed], dtype=torch.int64)
        _broadcast(self._pg, header.to(self.device))
        for t in body:
            _broadcast(self._pg, t.to(self.device))
        self.last = {"mode": mode, "changed": changed, "bytes": sum(t.nbytes for t in body)}
        # the sent buffer becomes the base; the next version is packed over the old base
        spare = self.base_P if self.base_P is not None else torch.empty_like(self.flat_P)
        self.base_P, self.flat_P, self.base_id = self.flat_P, spare, send_id


class DeltaReceiver(BroadcastReceiver):
    """A generator's side: `base` is the last version received (never written in place: the
    engine may still hold it), `base_id` its send id."""

    def __init__(
        self, group: BroadcastGroup, rank: int, device: torch.device | None = None,
        previous: object = None,
    ):  # fmt: skip
        super().__init__(group, rank, device)
        self.base: PackedWeights | None = None
        self.base_id = NO_BASE
        if isinstance(previous, DeltaReceiver) and previous.base is not None:
            b = previous.base
            if (b.layout, b.flat_P.dtype, b.flat_P.device) == (
                group.layout, group.dtype, self.device,
            ):  # fmt: skip
                self.base, self.base_id = b, previous.base_id

    def _receive(self) -> PackedWeights:
        _agree(self._pg, self.base_id, self.device)
        header = torch.zeros(4, dtype=torch.int64, device=self.device)
        _broadcast(self._pg, header)
        version, send_id, mode, changed = header.tolist()
        g = self.group
        if mode == FULL:
            flat_P = torch.empty(g.numel, dtype=g.dtype, device=self.device)
            _broadcast(self._pg, flat_P)
        else:
            assert self.base is not None, "a delta without a base"
            counts_C = torch.empty(
                delta_codec.chunks(g.numel), dtype=torch.int64, device=self.device
            )
            bits_B = torch.empty(
                delta_codec.mask_bytes(g.numel), dtype=torch.uint8, device=self.device
            )
            vals_K = torch.empty(changed, dtype=g.dtype, device=self.device)
            for t in (counts_C, bits_B, vals_K) if changed else (counts_C, bits_B):
                _broadcast(self._pg, t)
            flat_P = delta_codec.decode(self.base.flat_P, bits_B, vals_K, counts_C.cpu())
        self.base = PackedWeights(version=version, flat_P=flat_P, layout=g.layout)
        self.base_id = send_id
        return self.base
