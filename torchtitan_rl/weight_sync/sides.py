"""The trainer's and a generator's halves of the current weight sync, without Monarch: the
actors' four weight endpoints each call one method here (actors/trainer.py,
actors/generator.py), and tests drive these directly.

Each sync is known by a key the controller picks (`WeightSync.key`). Opening a sync under a
new key replaces the previous one (its state handed over, then it is closed); a call under
a key that is no longer current fails with a clear message, and closing an old key is a
no-op, so a sync abandoned after a replica died can never disturb the one that replaced it.

A sync moves one payload (weight_sync/lora_sync.py): the merged weights (FULL), or with
[lora] the frozen base once (BASE) and then the adapters (ADAPTERS). The sending side only
packs what it is given; the receiving side turns each payload into what its engine loads,
by how the engine takes adapters (`AdapterUse`: merged here, or served by the engine).
A BASE sync's buffers are one-time: both sides drop them as it ends (the generator once it
holds the base in host memory, the trainer when the sync closes) and hand the memory back
to the device (`release_cached_memory`), which the other process on a shared GPU may need.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import torch

from torchtitan_rl.device import release_cached_memory
from torchtitan_rl.generation.interface import AdapterUse
from torchtitan_rl.models.lora import GeneratorBase
from torchtitan_rl.weight_sync.lora_sync import NO_BASE, LoRABase, Payload, ServedBase
from torchtitan_rl.weight_sync.packing import (
    Layout,
    PackedWeights,
    gather_into,
    make_layout,
    unpack_weights,
)
from torchtitan_rl.weight_sync.strategies import TRANSPORTS, Receiver, Sender


class SendingSide:
    """Trainer rank 0's half: the sender of the current sync."""

    def __init__(self, device: torch.device):
        self.device = device
        """Rank 0's compute device (a GPU buffer lives there)."""
        self.key: str | None = None
        self.sender: Sender | None = None
        self.layout: Layout | None = None
        self.closed: Sender | None = None
        """The sender closed last, kept until the next opens: it hands over its state (the
        delta transport's base), so a sync reopened after a replica died sends deltas."""
        self.base_id = _new_id()
        """[lora]: names the frozen base this process sends (BASE payloads); a generator
        holding another id (or none) gets the base before adapters (lora_sync.py). A new
        one whenever the base changes (`new_base`: the warm start trained it)."""
        self.sync_base = NO_BASE
        """The base id the current ADAPTERS sync opened with (NO_BASE for other payloads):
        adapters are never sent to generators that hold an older base."""
        self.last_bytes = 0
        """Bytes of the last packed payload (tests, benchmarks)."""
        self.payload = Payload.FULL
        """What the current (or last) sync moves."""

    def open(
        self, key: str, transport: str, *, state: dict[str, torch.Tensor], dtype: torch.dtype,
        receivers: int, backend: str, payload: Payload = Payload.FULL, base_id: int = NO_BASE,
    ) -> Any:  # fmt: skip
        """Opens `transport` for `receivers` generators; returns what they need to join.
        `base_id`: for an ADAPTERS sync, the base its generators hold (checked at each send)."""
        layout, numel = make_layout(state)
        sender = TRANSPORTS[transport].sender(
            layout=layout, numel=numel, dtype=dtype, receivers=receivers, device=self.device,
            backend=backend, previous=self.sender or self.closed,
        )  # fmt: skip
        self.close(self.key)
        self.key, self.sender, self.layout, self.closed = key, sender, layout, None
        self.payload = Payload(payload)
        self.sync_base = base_id
        return sender.offer

    def new_base(self) -> None:
        """The base changed: a new id, so every generator gets it before the next adapters
        (the controller reopens the sync: `WeightSync.create` reads the id)."""
        self.base_id = _new_id()

    def form(self, key: str) -> None:
        self._current(key).form()

    def send(self, key: str, state: dict[str, torch.Tensor], version: int) -> tuple[int, Any]:
        """Packs `state` (a collective under a multi-rank mesh: the other ranks call
        `gather_into(state, None)` meanwhile) and sends it; (version, payload for relays)."""
        sender = self._current(key)
        layout, _ = make_layout(state)
        if layout != self.layout:
            raise RuntimeError("the weights' layout changed since the weight sync opened")
        flat_P = sender.buffer()
        gather_into(state, flat_P)  # first: the other ranks are in this collective
        if self.sync_base not in (NO_BASE, self.base_id):
            raise RuntimeError(
                f"weight sync {key} sends adapters for base {self.sync_base}, but the base "
                f"is now {self.base_id}: reopen the sync so generators get the new base first"
            )
        self.last_bytes = flat_P.numel() * flat_P.element_size()
        return version, sender.send(version)

    def close(self, key: str | None) -> None:
        """Drops the sender of `key` if it is the current one (no collective). A BASE
        sync's sender is dropped whole (its buffer, as large as the model, serves no later
        sync) and its memory handed back to the device."""
        if key is not None and key == self.key and self.sender is not None:
            self.sender.close()
            base = self.payload is Payload.BASE
            self.closed, self.key, self.sender = None if base else self.sender, None, None
            if base:
                release_cached_memory(self.device)

    def _current(self, key: str) -> Sender:
        if key != self.key or self.sender is None:
            raise RuntimeError(f"weight sync {key} is closed (current: {self.key})")
        return self.sender


def _new_id() -> int:
    return int.from_bytes(os.urandom(6), "little")


class ReceivingSide:
    """A generator's half: the receiver of the current sync, and with [lora] the frozen
    base it merges adapters into (kept across syncs), or hands to an engine that serves
    adapters itself."""

    def __init__(
        self, device: torch.device, adapter_use: AdapterUse = AdapterUse.MERGE,
        base_placement: GeneratorBase = "auto", cap_bytes: int = 0,
    ):  # fmt: skip
        """`adapter_use`: the engine's (`GenerationEngine.adapter_use`); `base_placement`:
        lora.generator_base, `cap_bytes`: generator.gpu_memory_gib in bytes (`LoRABase`)."""
        self.device = device
        self.adapter_use = AdapterUse(adapter_use)
        self.base_placement, self.cap_bytes = base_placement, cap_bytes
        """How the engine takes [lora] versions; FULL: it holds no base, so every sync to
        it moves the merged weights (transport.py `_payload`)."""
        self.key: str | None = None
        self.receiver: Receiver | None = None
        self.payload = Payload.FULL
        """What the current sync moves."""
        self.base_id = NO_BASE
        """The base id the current sync's BASE or ADAPTERS payloads belong to."""
        self.lora: LoRABase | ServedBase | None = None
        """[lora]: the base received last (None before one arrives)."""
        self.transport: str | None = None
        """The current sync's transport (a key of strategies.TRANSPORTS)."""

    @property
    def held_base(self) -> int:
        """The id of the base this side holds (NO_BASE: none)."""
        return NO_BASE if self.lora is None else self.lora.base_id

    async def join(
        self, key: str, transport: str, offer: Any, rank: int,
        payload: Payload = Payload.FULL, base_id: int = NO_BASE,
    ) -> None:  # fmt: skip
        """Becomes member `rank` of the sync's group; returns once it has formed (off the
        event loop: forming waits for every member). ADAPTERS need base `base_id` here."""
        if payload is Payload.ADAPTERS and self.held_base != base_id:
            raise RuntimeError(f"adapters for base {base_id}, but this generator holds "
                               f"{self.held_base}: the base must be sent first")  # fmt: skip
        receiver = TRANSPORTS[transport].receiver(offer, rank, self.device, self.receiver)
        await asyncio.to_thread(receiver.form)
        previous, self.key, self.receiver = self.receiver, key, receiver
        after_base = self.payload is Payload.BASE
        self.payload, self.base_id, self.transport = Payload(payload), base_id, transport
        if previous is not None:
            previous.close()
            del previous
            if after_base:  # what a group's receiver kept of the base (the delta's copy)
                release_cached_memory(self.device)

    async def receive(self, key: str, payload: Any, index: int) -> PackedWeights:
        if key != self.key or self.receiver is None:
            raise RuntimeError(f"weight sync {key} is closed here (current: {self.key})")
        return await self.receiver.receive(payload, index)

    async def take(
        self, key: str, payload: Any, index: int, dtype: torch.dtype
    ) -> tuple[int, tuple[Mapping[str, torch.Tensor], bool] | None]:
        """`receive`, then `engine_weights`: (version, what the engine loads or None). Once
        a BASE is in host memory its received buffer is handed back to the device; a
        transport through the controller has no group to leave, so its receiver goes too
        (with the CUDA IPC mapping of the trainer's buffer, which the trainer can then
        free as the sync closes). A group's receiver stays a member until the next sync
        replaces it (`join`): leaving now could pull out of a broadcast the trainer has
        not finished."""
        packed = await self.receive(key, payload, index)
        version, load = packed.version, self.engine_weights(packed, dtype)
        if self.payload is Payload.BASE:
            del packed
            if TRANSPORTS[self.transport].relay:
                self.receiver.close()
                self.receiver = None
            release_cached_memory(self.device)
        return version, load

    def engine_weights(
        self, packed: PackedWeights, dtype: torch.dtype
    ) -> tuple[Mapping[str, torch.Tensor], bool] | None:
        """What the engine loads for `packed` (a payload of the current sync): (state,
        partial), or None for a BASE (kept until adapters come). `dtype`: the engine's."""
        if self.payload is Payload.FULL:
            return unpack_weights(packed), False
        serve = self.adapter_use is AdapterUse.SERVE
        if self.payload is Payload.BASE:
            if serve:
                self.lora = ServedBase(packed, self.base_id)
            else:
                self.lora = LoRABase(
                    packed, self.base_id, self.device, self.base_placement, self.cap_bytes
                )
            return None
        assert self.lora is not None and self.lora.base_id == self.base_id
        return self.lora.adapters(packed) if serve else self.lora.merge(packed, dtype)

    def close(self) -> None:
        """Leaves the current sync (the generator is closing)."""
        if self.receiver is not None:
            self.receiver.close()
        self.key = self.receiver = None
