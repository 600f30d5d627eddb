"""Moving the trainer's weights to every generator replica; the transport is chosen once.

- `CUDA_IPC`: trainer rank 0 and every generator on GPUs of one host. Rank 0 packs the weights
  into a GPU buffer it keeps for the run and returns CUDA IPC handles to it; each generator
  opens the buffer and copies it device to device. Only those handles pass through Monarch.
- `BROADCAST`: anything else (CPU, other hosts). Rank 0 packs the weights and broadcasts
  them in a process group of its own with every generator (weight_sync/broadcast.py): NCCL
  from its GPU buffer when every generator computes on a GPU, else gloo from a CPU buffer;
  the bytes never pass through the controller.
- `CONTROLLER`: the fallback when the broadcast group cannot be opened (or forced with
  `launcher.weight_transport = "controller"`). Rank 0 returns the
  packed buffer on CPU and the controller passes it to each generator.

Either way a sync returns once every generator holds its own copy of version v, which its
engine applies between engine steps (generation/engine.py, `weight_sync_mode`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from enum import StrEnum

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError

from torchtitan_rl.weight_sync.broadcast import BroadcastBroken

logger = logging.getLogger(__name__)


class WeightTransport(StrEnum):
    CUDA_IPC = "cuda_ipc"
    BROADCAST = "broadcast"
    CONTROLLER = "controller"


async def choose_transport(trainer, generators, wanted: str = "auto") -> WeightTransport:
    """CUDA_IPC when every generator process sees trainer rank 0's GPU, else BROADCAST; a
    `wanted` other than "auto" is taken as it is."""
    if wanted != "auto":
        return WeightTransport(wanted)
    uuids = [u for u in (await trainer.cuda_uuid.call()).values() if u]
    if not uuids:
        return WeightTransport.BROADCAST
    seen = await asyncio.gather(*(g.cuda_uuids.call_one() for g in generators))
    if all(uuids[0] in s for s in seen):
        return WeightTransport.CUDA_IPC
    return WeightTransport.BROADCAST


async def broadcast_backend(trainer, generators) -> str:
    """ "nccl" when trainer rank 0 and every generator compute on GPUs, each on a GPU of its
    own (NCCL refuses two members on one GPU), else "gloo"."""
    uuids = [u for u in (await trainer.cuda_uuid.call()).values() if u][:1]
    wheres = await asyncio.gather(*(g.where.call_one() for g in generators))
    uuids += [w.get("uuid") for w in wheres]  # `where` names a GPU only for one on a GPU
    return "nccl" if None not in uuids and len(set(uuids)) == len(generators) + 1 else "gloo"


PEER_FAILURE_WAIT_S = 30.0
"""After one member of a broadcast failed, how long the others get to fail with their own
error (Monarch reports a dead process ~10 s after, a dead host after launcher.host_timeout_s
plus ~9 s; `Controller.start` sets it from host_timeout_s)."""


class WeightSync:
    """`await weight_sync()` pushes the trainer's current weights, in `dtype` ("float32" |
    "bfloat16", the generators' dtype), to every generator; returns the seconds it took."""

    def __init__(self, trainer, generators, dtype: str, transport: WeightTransport):
        self.trainer = trainer
        self.generators = list(generators)
        self.dtype = dtype
        self.transport = transport
        self.version: int | None = None
        """The policy version the last sync delivered (None before the first)."""
        self.peer_failure_wait_s = PEER_FAILURE_WAIT_S
        self.backend: str | None = None
        """The broadcast group's backend ("gloo" | "nccl") once it is open."""

    @classmethod
    async def create(cls, trainer, generators, dtype: str, wanted: str = "auto") -> WeightSync:
        """The transport `choose_transport` picks, ready to use (a broadcast group opened);
        CONTROLLER, with a warning, when the group cannot be opened."""
        transport = await choose_transport(trainer, generators, wanted)
        sync = cls(trainer, generators, dtype, transport)
        if sync.transport is WeightTransport.BROADCAST:
            try:
                await sync.open_broadcast()
            except Exception as e:
                logger.warning("weight broadcast group: %s; syncing through the controller", e)
                sync.transport, sync.backend = WeightTransport.CONTROLLER, None
        return sync

    async def open_broadcast(self, backend: str | None = None) -> None:
        """Trainer rank 0 opens the group; generator i becomes its member i + 1; all of them
        form it together (within broadcast.FORM_TIMEOUT), so a trainer address the generators
        cannot reach fails here, where `create` falls back to the controller path. `backend`:
        None picks it (`broadcast_backend`); "gloo" forces CPU buffers (benchmarks)."""
        backend = backend or await broadcast_backend(self.trainer, self.generators)
        out = await self.trainer.open_broadcast.call(self.dtype, len(self.generators), backend)
        group = _rank0(out)
        await asyncio.gather(
            self.trainer.form_broadcast.call(),
            *(g.join_broadcast.call_one(group, i + 1) for i, g in enumerate(self.generators)),
        )
        self.backend = group.backend  # what rank 0 built (gloo for a CPU trainer)

    async def __call__(self) -> float:
        t0 = time.perf_counter()
        if self.transport is WeightTransport.CUDA_IPC:
            out = await self.trainer.share_weights.call(self.dtype, len(self.generators))
            shared = _rank0(out)
            self.version = shared.version
            await asyncio.gather(
                *(g.load_shared_weights.call_one(shared, i) for i, g in enumerate(self.generators))
            )
        elif self.transport is WeightTransport.BROADCAST:
            self.version = await self._broadcast()
        else:
            packed = _rank0(await self.trainer.publish_weights.call(self.dtype))
            self.version = packed.version
            await asyncio.gather(*(g.load_weights.call_one(packed) for g in self.generators))
        return time.perf_counter() - t0

    async def _broadcast(self) -> int:
        """One broadcast: the trainer sends while every generator receives. When one member
        fails the others fail too, and a generator's call may fail only later, with Monarch's
        report of the process that died (the more useful error): so after the first error
        the others get PEER_FAILURE_WAIT_S to say theirs, and a death wins."""
        calls = [
            asyncio.ensure_future(self.trainer.broadcast_weights.call()),
            *(asyncio.ensure_future(g.receive_weights.call_one()) for g in self.generators),
        ]
        try:
            _, pending = await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
            if pending:
                await asyncio.wait(pending, timeout=self.peer_failure_wait_s)
        finally:
            for call in calls:
                call.cancel() if not call.done() else None
        over = [c for c in calls if c.done() and not c.cancelled()]
        errors = [c.exception() for c in over if c.exception() is not None]
        if errors:
            deaths = [e for e in errors if _is_death(e)]
            if deaths:
                raise deaths[0]
            lines = [line.strip() for line in str(errors[0]).splitlines() if line.strip()]
            raise BroadcastBroken(f"the weight broadcast failed: {lines[-1]}") from errors[0]
        sent, *received = [c.result() for c in calls]
        version = _rank0(sent)
        assert received == [version] * len(received), (version, received)
        return version


def _is_death(error: BaseException) -> bool:
    """A process's death as Monarch reports it to a call on it."""
    if isinstance(error, ActorError):
        error = error.exception
    return isinstance(error, SupervisionError)


def _rank0(values):
    """The one non-None value of a trainer mesh call (rank 0 answers, the others say None)."""
    found = [v for v in values.values() if v is not None]
    assert len(found) == 1, f"expected one rank to answer, got {len(found)}"
    return found[0]
