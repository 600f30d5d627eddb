"""Moving the trainer's weights to every generator replica: `WeightSync`, the controller's
side, over the strategies of weight_sync/strategies.py (chosen once per sync).

- "cuda_ipc": trainer rank 0 and every generator on GPUs of one host. Rank 0 packs the
  weights into a GPU buffer it keeps and returns CUDA IPC handles to it; each generator
  opens the buffer and copies it device to device. Only those handles pass through Monarch.
- "broadcast": anything else (CPU, other hosts). Rank 0 packs the weights and broadcasts
  them in a process group of its own with every generator (weight_sync/broadcast.py): NCCL
  from its GPU buffer when every generator computes on a GPU, else gloo from a CPU buffer;
  the bytes never pass through the controller.
- "delta": the same group, sending only the elements that changed since the version every
  member holds (weight_sync/delta.py), a full send when one lacks it.
- "controller": the fallback of "auto" when its pick cannot be opened (or forced with
  `weight_sync.transport = "controller"`). Rank 0 returns the packed buffer on CPU and the
  controller passes it to each generator. A transport set by name that cannot be opened
  ends the run (`TransportUnavailable`); one that cannot work in the run at all is refused
  before it starts (`WeightSyncConfig.check_run`, controller/preflight.py).

With [lora] on and a backend that merges adapters itself (backends.py `adapter_sync`), a
sync moves only the adapters (weight_sync/lora_sync.py): `open` first sends the frozen base
to each generator that does not hold this trainer's (at start, a fresh or restarted
replica), in a sync of its own over those generators, then opens the adapter sync over all.

Either way a sync returns once every generator holds its own copy of version v, which its
engine applies between engine steps (generation/engine.py, `weight_sync_mode`). The set of
generators is fixed per sync: after one dies, or one is restarted, the owner of the replicas
closes the sync (`close`: no collective, a dead member cannot hang it) and creates a new one
over the generators it now has.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError

from torchtitan_rl.weight_sync.broadcast import BroadcastBroken
from torchtitan_rl.weight_sync.config import AUTO_BY_BACKEND, TRANSPORT_CHOICES, TransportChoice
from torchtitan_rl.weight_sync.lora_sync import NO_BASE, Payload
from torchtitan_rl.weight_sync.strategies import TRANSPORTS, Transport, TransportName

logger = logging.getLogger(__name__)


class TransportUnavailable(BroadcastBroken):
    """The transport weight_sync.transport names could not be opened in this run (a run
    with "auto" falls back instead); the message is the one line shown. A BroadcastBroken:
    a member that died while the group formed may be the cause, so the fleet and the
    Supervisor wait for a report of a death before this line stands."""

    needs_no_traceback = True


async def choose_transport(
    trainer, generators, wanted: TransportChoice = "auto", backend: str = "gloo"
) -> TransportName:
    """ "cuda_ipc" when every generator process sees trainer rank 0's GPU, else the group
    transport measured faster for `backend` (config.AUTO_BY_BACKEND); a `wanted` other than
    "auto" is taken as it is."""
    if wanted != "auto":
        return wanted
    uuids = [u for u in (await trainer.cuda_uuid.call()).values() if u]
    if uuids:
        seen = await asyncio.gather(*(g.cuda_uuids.call_one() for g in generators))
        if all(uuids[0] in s for s in seen):
            return "cuda_ipc"
    return AUTO_BY_BACKEND[backend]


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
    "bfloat16", the generators' dtype), to every generator of `generators`; returns the
    seconds it took. `create` again for another set of generators (after `close`)."""

    def __init__(
        self, trainer, generators, dtype: str, transport: TransportName,
        payload: Payload = Payload.FULL, base_id: int = NO_BASE,
    ):  # fmt: skip
        self.trainer = trainer
        self.generators = list(generators)
        self.dtype = dtype
        self.transport: TransportName = transport
        """The name of the strategy in use (a key of strategies.TRANSPORTS)."""
        self.key = uuid.uuid4().hex[:12]
        """This sync's name on the trainer and the generators (a newer sync replaces it)."""
        self.version: int | None = None
        """The policy version the last sync delivered (None before the first)."""
        self.peer_failure_wait_s = PEER_FAILURE_WAIT_S
        self.backend: str | None = None
        """The group's backend ("gloo" | "nccl") for a group transport once it is open."""
        self.payload = payload
        """What each call moves (lora_sync.py): FULL weights, or ADAPTERS over base `base_id`
        (a BASE sync is `open`'s own, once per generator that lacks the base)."""
        self.base_id = base_id
        self.base_sent_to = 0
        """Generators the last `open` sent the base to (tests, logs)."""

    @property
    def strategy(self) -> Transport:
        return TRANSPORTS[self.transport]

    @classmethod
    async def create(
        cls, trainer, generators, dtype: str, wanted: TransportChoice = "auto"
    ) -> WeightSync:
        """The transport `choose_transport` picks, opened (a group formed). When it cannot
        be opened: with `wanted` "auto", "controller" and a one-line warning (the traceback
        at DEBUG); with a transport named, TransportUnavailable; a member's death as it is.
        Call again with another list of generators when the set changes (`close` the old
        sync first)."""
        backend = await broadcast_backend(trainer, generators)
        transport = await choose_transport(trainer, generators, wanted, backend)
        payload, base_id = await _payload(trainer, generators)
        sync = cls(trainer, generators, dtype, transport, payload, base_id)
        try:
            await sync.open(backend)
        except Exception as e:
            if transport == "controller" or _is_death(e):
                raise
            why = _one_line(e)
            if wanted != "auto":
                others = ", ".join(f'"{t}"' for t in TRANSPORT_CHOICES if t != wanted)
                raise TransportUnavailable(
                    f'weight_sync.transport = "{wanted}" could not be opened ({why}); valid: '
                    f'{others} ("auto" falls back to "controller" when its pick cannot open)'
                ) from e
            logger.warning(
                'weight sync: "%s" could not be opened (%s); syncing through the controller '
                "(slower)", transport, why,
            )  # fmt: skip
            logger.debug("weight sync: %s failed to open", transport, exc_info=e)
            sync.transport = "controller"
            await sync.open(backend)
        return sync

    async def open(self, backend: str | None = None) -> None:
        """Trainer rank 0 opens the transport; generator i becomes its member i + 1; all of
        them form it together (a group within broadcast.FORM_TIMEOUT, so a trainer address
        the generators cannot reach fails here). `backend`: None picks it
        (`broadcast_backend`); "gloo" forces CPU buffers (benchmarks)."""
        backend = backend or await broadcast_backend(self.trainer, self.generators)
        if self.payload is Payload.ADAPTERS:
            await self._send_base(backend)
        out = await self.trainer.weights_open.call(
            self.key, self.transport, self.dtype, len(self.generators), backend, self.payload
        )
        offer = _rank0(out, allow_none=True)
        await asyncio.gather(
            self.trainer.weights_form.call(self.key),
            *(
                g.weights_join.call_one(
                    self.key, self.transport, offer, i + 1, self.payload, self.base_id
                )
                for i, g in enumerate(self.generators)
            ),
        )
        self.backend = None if self.strategy.relay else offer.backend  # what rank 0 built

    async def _send_base(self, backend: str) -> None:
        """The frozen base to every generator that does not hold base `base_id`, by a sync
        of this transport over those alone (opened, sent once, closed)."""
        held = await asyncio.gather(*(g.weights_base.call_one() for g in self.generators))
        lacking = [g for g, h in zip(self.generators, held) if h != self.base_id]
        self.base_sent_to = len(lacking)
        if not lacking:
            return
        once = WeightSync(self.trainer, lacking, self.dtype, self.transport, Payload.BASE,
                          self.base_id)  # fmt: skip
        once.peer_failure_wait_s = self.peer_failure_wait_s
        await once.open(backend)
        try:
            await once()
        finally:
            await once.close()

    async def __call__(self) -> float:
        t0 = time.perf_counter()
        if self.strategy.relay:
            version, payload = _rank0(await self.trainer.weights_send.call(self.key, self.payload))
            got = await asyncio.gather(
                *(g.weights_receive.call_one(self.key, payload, i)
                  for i, g in enumerate(self.generators))
            )  # fmt: skip
        else:
            version, got = await self._collective()
        assert got == [version] * len(got), (version, got)
        self.version = version
        return time.perf_counter() - t0

    async def close(self) -> None:
        """Abandons this sync: the trainer drops its side (an open group is aborted, never
        waited on), so a new sync can open over other generators. A generator drops its side
        when it joins the next sync; nothing here calls a generator, which may be dead."""
        await self.trainer.weights_close.call(self.key)

    async def _collective(self) -> tuple[int, list[int]]:
        """One send in the group: the trainer sends while every generator receives. When
        one member fails the others fail too, and a generator's call may fail only later,
        with Monarch's report of the process that died (the more useful error): so after the
        first error the others get PEER_FAILURE_WAIT_S to say theirs, and a death wins."""
        calls = [
            asyncio.ensure_future(self.trainer.weights_send.call(self.key, self.payload)),
            *(asyncio.ensure_future(g.weights_receive.call_one(self.key, None, i))
              for i, g in enumerate(self.generators)),
        ]  # fmt: skip
        for call in calls:  # read here when the sync is given up (a member died): no warning
            call.add_done_callback(_heard)
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
        version, _ = _rank0(sent)
        return version, received


def _heard(call: asyncio.Future) -> None:
    if not call.cancelled():
        call.exception()


async def _payload(trainer, generators) -> tuple[Payload, int]:
    """(ADAPTERS, the trainer's base id) when the trainer trains [lora] adapters and every
    generator's backend merges adapters itself; else (FULL, NO_BASE)."""
    base_id = _rank0(await trainer.weights_base.call(), allow_none=True)
    held = await asyncio.gather(*(g.weights_base.call_one() for g in generators))
    if base_id is None or None in held:
        return Payload.FULL, NO_BASE
    return Payload.ADAPTERS, base_id


def _one_line(error: BaseException) -> str:
    """`error` as one line: a failed actor call's remote exception, without the traceback
    Monarch puts in its text (e.g. "AssertionError: Torch not compiled with CUDA enabled")."""
    if isinstance(error, ActorError):
        error = error.exception
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _is_death(error: BaseException) -> bool:
    """A process's death as Monarch reports it to a call on it."""
    if isinstance(error, ActorError):
        error = error.exception
    return isinstance(error, SupervisionError)


def _rank0(values, allow_none: bool = False):
    """The one non-None value of a trainer mesh call (rank 0 answers, the others say None);
    `allow_none`: rank 0 may say None too (a transport with nothing to offer)."""
    found = [v for v in values.values() if v is not None]
    if allow_none and not found:
        return None
    assert len(found) == 1, f"expected one rank to answer, got {len(found)}"
    return found[0]
