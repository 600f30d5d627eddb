"""The trainer's and a generator's halves of the current weight sync, without Monarch: the
actors' four weight endpoints each call one method here (actors/trainer.py,
actors/generator.py), and tests drive these directly.

Each sync is known by a key the controller picks (`WeightSync.key`). Opening a sync under a
new key replaces the previous one (its state handed over, then it is closed); a call under
a key that is no longer current fails with a clear message, and closing an old key is a
no-op, so a sync abandoned after a replica died can never disturb the one that replaced it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from torchtitan_rl.weight_sync.packing import Layout, PackedWeights, gather_into, make_layout
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

    def open(
        self, key: str, transport: str, *, state: dict[str, torch.Tensor], dtype: torch.dtype,
        receivers: int, backend: str,
    ) -> Any:  # fmt: skip
        """Opens `transport` for `receivers` generators; returns what they need to join."""
        layout, numel = make_layout(state)
        sender = TRANSPORTS[transport].sender(
            layout=layout, numel=numel, dtype=dtype, receivers=receivers, device=self.device,
            backend=backend, previous=self.sender or self.closed,
        )  # fmt: skip
        self.close(self.key)
        self.key, self.sender, self.layout, self.closed = key, sender, layout, None
        return sender.offer

    def form(self, key: str) -> None:
        self._current(key).form()

    def send(self, key: str, state: dict[str, torch.Tensor], version: int) -> tuple[int, Any]:
        """Packs `state` (a collective under a multi-rank mesh: the other ranks call
        `gather_into(state, None)` meanwhile) and sends it; (version, payload for relays)."""
        sender = self._current(key)
        layout, _ = make_layout(state)
        if layout != self.layout:
            raise RuntimeError("the weights' layout changed since the weight sync opened")
        gather_into(state, sender.buffer())
        return version, sender.send(version)

    def close(self, key: str | None) -> None:
        """Drops the sender of `key` if it is the current one (no collective)."""
        if key is not None and key == self.key and self.sender is not None:
            self.sender.close()
            self.closed, self.key, self.sender = self.sender, None, None

    def _current(self, key: str) -> Sender:
        if key != self.key or self.sender is None:
            raise RuntimeError(f"weight sync {key} is closed (current: {self.key})")
        return self.sender


class ReceivingSide:
    """A generator's half: the receiver of the current sync."""

    def __init__(self, device: torch.device):
        self.device = device
        self.key: str | None = None
        self.receiver: Receiver | None = None

    async def join(self, key: str, transport: str, offer: Any, rank: int) -> None:
        """Becomes member `rank` of the sync's group; returns once it has formed (off the
        event loop: forming waits for every member)."""
        receiver = TRANSPORTS[transport].receiver(offer, rank, self.device, self.receiver)
        await asyncio.to_thread(receiver.form)
        previous, self.key, self.receiver = self.receiver, key, receiver
        if previous is not None:
            previous.close()

    async def receive(self, key: str, payload: Any, index: int) -> PackedWeights:
        if key != self.key or self.receiver is None:
            raise RuntimeError(f"weight sync {key} is closed here (current: {self.key})")
        return await self.receiver.receive(payload, index)

    def close(self) -> None:
        """Leaves the current sync (the generator is closing)."""
        if self.receiver is not None:
            self.receiver.close()
        self.key = self.receiver = None
