"""Weights straight from trainer rank 0 to every generator, on any host: one broadcast in a
process group of their own, never through the controller. The group's backend is NCCL when
rank 0 and every generator compute on GPUs (the buffer stays on the GPUs: NVLink within a
host, InfiniBand or sockets across hosts), else gloo over TCP with CPU buffers.

    group rank 0      = trainer rank 0 (the source; it also serves the group's TCPStore)
    group rank i + 1  = generator replica i

Once per `WeightSync` (at start, and again whenever the set of generators changes), rank 0
opens a group (`BroadcastSender`, a free port on its host) and returns a `BroadcastGroup`
record: where to meet, plus the layout every receiver allocates for. Then every member forms
the group at once (`form`, within FORM_TIMEOUT, and one small broadcast through it), so an
address the generators cannot reach shows at start, where `WeightSync.create` falls back to
the controller path (weight_sync.transport = "auto"; a transport set by name ends the run).
At each sync both sides enter the same two broadcasts: the policy version (one int64), then
the packed buffer (`packing.py` layout); weight_sync/delta.py sends only what changed
instead. A group is left by dropping it (`close`: no collective, so a member that died
cannot hang the others).

Why gloo and not Monarch's RDMABuffer on CPU: without ibverbs RDMABuffer runs over its TCP
fallback, slower than gloo's TCP (docs/hosts.md, "Measured here";
scripts/bench_weight_sync.py --hosts measures both side by side).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan_rl.weight_sync.packing import Layout, PackedWeights

BROADCAST_TIMEOUT = timedelta(seconds=600)
"""How long a member waits for the others (forming the group, or one broadcast): long
enough for a 32B model in bf16 (64 GB) at ~1 GB/s; a dead member ends the run sooner
through the Supervisor."""


FORM_TIMEOUT = timedelta(seconds=60)
"""How long forming the group may take (every member meeting at the store)."""


class BroadcastBroken(RuntimeError):
    """A weight broadcast failed on some member, most likely because another member's
    process died (gloo: "Connection closed by peer"). The Supervisor waits a moment for
    Monarch's report of which process it was, and says that instead."""


@dataclass(kw_only=True, slots=True)
class BroadcastGroup:
    """Where the group meets and what travels in it (a few KB: the layout), e.g.
    BroadcastGroup(addr="trainer-node-3", port=41233, world_size=3, numel=7_000_000,
    dtype=torch.bfloat16, layout=[("tok_embeddings.weight", (96, 256), 0), ...])."""

    addr: str
    port: int
    world_size: int
    numel: int
    dtype: torch.dtype
    layout: Layout
    backend: str = "gloo"
    """"gloo" (CPU buffers) or "nccl" (every member's buffer on its GPU)."""


def _group(store: dist.Store, rank: int, size: int, device: torch.device) -> dist.ProcessGroup:
    """The group over `store` (which forming waits on for FORM_TIMEOUT); its broadcasts may
    each take BROADCAST_TIMEOUT. NCCL when `device` is a GPU (this thread's current device
    becomes `device`), else gloo."""
    store.set_timeout(FORM_TIMEOUT)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = BROADCAST_TIMEOUT
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        pg = dist.ProcessGroupGloo(store, rank, size, BROADCAST_TIMEOUT)
    # every pair connected and answering (NCCL builds its communicator here)
    _broadcast(pg, torch.zeros(1, dtype=torch.int64, device=device))
    store.set_timeout(BROADCAST_TIMEOUT)
    return pg


def _broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast from group rank 0; returns once `tensor` holds the values (on a GPU: the
    current stream waits for NCCL's, then the host waits for the stream)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


class BroadcastSender:
    """Trainer rank 0's side: the group's store and a packed buffer kept for the run (on
    rank 0's GPU for NCCL, in host memory for gloo)."""

    def __init__(
        self, layout: Layout, numel: int, dtype: torch.dtype, receivers: int,
        device: torch.device | None = None, previous: object = None,
    ):  # fmt: skip
        """`device`: a GPU makes the group NCCL and the buffer a GPU one (every receiver must
        then be on a GPU too); the CPU makes it gloo. `previous`: the sender this one
        replaces (unused here; weight_sync/delta.py keeps its base)."""
        device = device or torch.device("cpu")
        addr = os.environ.get("MASTER_ADDR") or socket.gethostname()  # what other hosts dial
        self.store = dist.TCPStore(
            addr, 0, receivers + 1, is_master=True, timeout=BROADCAST_TIMEOUT,
            wait_for_workers=False,
        )  # fmt: skip
        self.group = BroadcastGroup(
            addr=addr, port=self.store.port, world_size=receivers + 1, numel=numel,
            dtype=dtype, layout=layout, backend="nccl" if device.type == "cuda" else "gloo",
        )  # fmt: skip
        self.device = device
        self.flat_P = torch.empty(numel, dtype=dtype, device=device)
        """Filled by the caller (`gather_into`) before each `send`."""
        self._pg: dist.ProcessGroup | None = None

    @property
    def offer(self) -> BroadcastGroup:
        """What every receiver needs to join."""
        return self.group

    def buffer(self) -> torch.Tensor:
        """The buffer the trainer packs the next version into."""
        return self.flat_P

    def form(self) -> None:
        """Meet every receiver (each in `BroadcastReceiver.form` meanwhile)."""
        self._pg = _group(self.store, 0, self.group.world_size, self.device)

    def send(self, version: int) -> None:
        """Broadcast `version`, then `flat_P`; returns once every receiver has it."""
        assert self._pg is not None, "form the group first"
        _broadcast(self._pg, torch.tensor([version], dtype=torch.int64, device=self.device))
        _broadcast(self._pg, self.flat_P)

    def close(self) -> None:
        """Leave the group without a word to the others (any of them may be dead)."""
        self._pg = _drop(self._pg)
        self.store = None


class BroadcastReceiver:
    """A generator's side: member `rank` (>= 1) of `group`; each receive fills a new
    buffer (on `device`, a GPU, when the group is NCCL), which the engine keeps until it
    applies it."""

    def __init__(
        self, group: BroadcastGroup, rank: int, device: torch.device | None = None,
        previous: object = None,
    ):  # fmt: skip
        """`previous`: the receiver this one replaces (unused here; delta.py keeps its base)."""
        assert 1 <= rank < group.world_size, (rank, group.world_size)
        self.group = group
        self.rank = rank
        self.device = torch.device("cpu") if group.backend == "gloo" else device
        if group.backend == "nccl" and (device is None or device.type != "cuda"):
            raise ValueError(f"an NCCL weight group needs receivers on GPUs, got {device}")
        self._pg: dist.ProcessGroup | None = None
        self._lock = threading.Lock()
        """One receive at a time: two in flight would pair one's version broadcast with the
        other's buffer (gloo aborts the process on the size mismatch; NCCL would not see it)."""

    def form(self) -> None:
        """Meet the sender and the other receivers (the sender in `form` meanwhile)."""
        g = self.group
        store = dist.TCPStore(g.addr, g.port, g.world_size, is_master=False,
                              timeout=FORM_TIMEOUT)  # fmt: skip
        self._pg = _group(store, self.rank, g.world_size, self.device)

    def receive_blocking(self) -> PackedWeights:
        assert self._pg is not None, "form the group first"
        with self._lock:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # this thread's (receive runs off the loop)
            # NCCL: on the device's default stream, which the engine shares, so the engine's
            # kernels queued after a receive began wait until the trainer sends (the
            # controller starts both at once; a receive on a stream of its own did not finish
            # the 2-GPU end-to-end test, see docs/hosts.md "Known limits")
            return self._receive()

    def _receive(self) -> PackedWeights:
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        _broadcast(self._pg, version)
        flat_P = torch.empty(self.group.numel, dtype=self.group.dtype, device=self.device)
        _broadcast(self._pg, flat_P)
        return PackedWeights(version=int(version.item()), flat_P=flat_P, layout=self.group.layout)

    async def receive(self, payload: None = None, index: int = 0) -> PackedWeights:
        """The next broadcast, waited for off the event loop (the engine keeps generating;
        with NCCL its GPU work waits for the broadcast, see `receive_blocking`). Nothing
        comes through the controller (`payload` is None)."""
        return await asyncio.to_thread(self.receive_blocking)

    def close(self) -> None:
        """Leave the group (a receive still waiting in it fails)."""
        self._pg = _drop(self._pg)


def _drop(pg: dist.ProcessGroup | None) -> None:
    """Abort `pg` (no collective: an operation still waiting in it fails), then drop it."""
    if pg is not None:
        pg.abort()
