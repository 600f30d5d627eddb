"""Weight transports as strategies: one row of `TRANSPORTS` per `weight_sync.transport` name,
each a pair of halves with one interface (the only place a transport name is looked up).

    sender   = TRANSPORTS[name].sender(layout=..., numel=..., dtype=..., receivers=3,
                                       device=rank0_device, backend="gloo", previous=old)
    offer    = sender.offer            # what each receiver needs to join (or None)
    receiver = TRANSPORTS[name].receiver(offer, rank=i + 1, device=gen_device, previous=old)
    sender.form() | receiver.form()    # every member at once
    gather_into(state, sender.buffer()); payload = sender.send(version)
    packed = await receiver.receive(payload, index=i)   # -> PackedWeights of that version

`relay` transports hand the payload to each receiver through the controller (CUDA IPC
handles, or the packed buffer itself); the others are collectives in a group of their own,
where the trainer sends while every receiver receives, and the payload is None. `previous`
is the half this one replaces when a new sync is opened over another set of generators (the
delta transport keeps its base from it); the caller closes it afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from torchtitan_rl.weight_sync.broadcast import BroadcastReceiver, BroadcastSender
from torchtitan_rl.weight_sync.delta import DeltaReceiver, DeltaSender
from torchtitan_rl.weight_sync.packing import (
    Layout,
    PackedWeights,
    SharedBuffer,
    SharedReader,
    SharedWeights,
)

TransportName = Literal["cuda_ipc", "broadcast", "delta", "controller"]


class Sender(Protocol):
    offer: Any

    def buffer(self) -> torch.Tensor: ...
    def form(self) -> None: ...
    def send(self, version: int) -> Any: ...
    def close(self) -> None: ...


class Receiver(Protocol):
    def form(self) -> None: ...
    async def receive(self, payload: Any, index: int) -> PackedWeights: ...
    def close(self) -> None: ...


class IpcSender:
    """Rank 0's GPU buffer, shared by CUDA IPC handles (one per receiver)."""

    offer = None

    def __init__(self, *, layout, numel, dtype, receivers, device, backend, previous):
        self.receivers = receivers
        self.shared = SharedBuffer(layout, numel, dtype, device)

    def buffer(self) -> torch.Tensor:
        return self.shared.flat_P

    def form(self) -> None:
        pass

    def send(self, version: int) -> SharedWeights:
        return self.shared.publish(version, self.receivers)

    def close(self) -> None:
        self.shared = None


class IpcReceiver:
    """Opens rank 0's buffer once, copies it at every sync (`SharedReader`)."""

    def __init__(self, offer: None, rank: int, device: torch.device, previous: object):
        self.reader = SharedReader(device)

    def form(self) -> None:
        pass

    async def receive(self, payload: SharedWeights, index: int) -> PackedWeights:
        return self.reader.read(payload, index)

    def close(self) -> None:
        self.reader.close()


class ControllerSender:
    """A fresh packed CPU buffer per sync, returned to the controller."""

    offer = None

    def __init__(self, *, layout, numel, dtype, receivers, device, backend, previous):
        self.layout, self.numel, self.dtype = layout, numel, dtype
        self.flat_P: torch.Tensor | None = None

    def buffer(self) -> torch.Tensor:
        self.flat_P = torch.empty(self.numel, dtype=self.dtype)
        return self.flat_P

    def form(self) -> None:
        pass

    def send(self, version: int) -> PackedWeights:
        flat_P, self.flat_P = self.flat_P, None
        return PackedWeights(version=version, flat_P=flat_P, layout=self.layout)

    def close(self) -> None:
        self.flat_P = None


class ControllerReceiver:
    """Takes the buffer the controller passes on. The engine keeps the tensors until it
    applies them, so they get memory of their own (tied names stay views of one tensor)."""

    def __init__(self, offer: None, rank: int, device: torch.device, previous: object):
        pass

    def form(self) -> None:
        pass

    async def receive(self, payload: PackedWeights, index: int) -> PackedWeights:
        return PackedWeights(
            version=payload.version, flat_P=payload.flat_P.clone(), layout=payload.layout
        )

    def close(self) -> None:
        pass


def _group_sender(cls: type[BroadcastSender]) -> Callable[..., Sender]:
    """A group's sender: its buffer on rank 0's GPU for NCCL, in host memory for gloo."""

    def make(*, layout: Layout, numel, dtype, receivers, device, backend, previous):
        device = device if backend == "nccl" else torch.device("cpu")
        return cls(layout, numel, dtype, receivers, device, previous)

    return make


@dataclass(frozen=True, slots=True)
class Transport:
    relay: bool
    """True: the payload travels through the controller (send, then each receive)."""
    sender: Callable[..., Sender]
    receiver: Callable[..., Receiver]


TRANSPORTS: dict[str, Transport] = {
    "cuda_ipc": Transport(relay=True, sender=IpcSender, receiver=IpcReceiver),
    "broadcast": Transport(
        relay=False, sender=_group_sender(BroadcastSender), receiver=BroadcastReceiver
    ),
    "delta": Transport(relay=False, sender=_group_sender(DeltaSender), receiver=DeltaReceiver),
    "controller": Transport(relay=True, sender=ControllerSender, receiver=ControllerReceiver),
}
