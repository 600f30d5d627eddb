"""Choosing and driving a weight transport (weight_sync/transport.py) against fake actors:
CUDA IPC only when every generator sees the trainer's GPU, NCCL only when every member has a
GPU of its own, a forced transport is taken, a group that cannot open falls back to the
controller, a broken group reports the death a generator learns of later, and every
replica gets every sync (relays: with its own index)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from torchtitan_rl.weight_sync.broadcast import BroadcastBroken
from torchtitan_rl.weight_sync.config import AUTO_BY_BACKEND
from torchtitan_rl.weight_sync.strategies import TRANSPORTS
from torchtitan_rl.weight_sync.transport import WeightSync, choose_transport


class _Values:
    def __init__(self, values):
        self._values = values

    def values(self):
        return self._values


class _Endpoint:
    def __init__(self, fn):
        self.fn = fn

    async def call(self, *args):
        return _Values(self.fn(*args))

    async def call_one(self, *args):
        return self.fn(*args)


class FakeTrainer:
    """Two ranks; rank 0 answers (a GPU named "gpu-0", or none on CPU)."""

    def __init__(self, uuid):
        self.cuda_uuid = _Endpoint(lambda: [uuid, None])
        self.version = 3
        self.opened, self.closed = [], []
        self.weights_open = _Endpoint(self._open)
        self.weights_form = _Endpoint(lambda key: [None, None])
        self.weights_send = _Endpoint(lambda key, payload: [(self.version, f"payload-{key}"), None])
        self.weights_base = _Endpoint(lambda: [None, None])  # no [lora]
        self.weights_close = _Endpoint(lambda key: self.closed.append(key) or [None, None])

    def _open(self, key, transport, dtype, receivers, backend, payload):
        self.opened.append((transport, receivers, backend))
        relay = TRANSPORTS[transport].relay
        return [None if relay else SimpleNamespace(backend=backend), None]


class FakeGenerator:
    def __init__(self, uuids, device="cpu"):
        self.cuda_uuids = _Endpoint(lambda: uuids)
        gpu = {"uuid": f"gpu-{device[5:]}"} if device.startswith("cuda") else {}
        self.where = _Endpoint(lambda: {"role": "generator", "device": device, **gpu})
        self.loaded = []
        self.weights_join = _Endpoint(
            lambda key, transport, offer, rank, *payload: self.loaded.append((transport, rank))
        )
        self.weights_base = _Endpoint(lambda: -1)
        self.weights_receive = _Endpoint(self._receive)

    def _receive(self, key, payload, index):
        self.loaded.append((payload, index))
        return 3


def test_cuda_ipc_only_when_every_generator_sees_the_trainer_gpu():
    def choose(trainer_uuid, *generator_uuids):
        gens = [FakeGenerator(u) for u in generator_uuids]
        return asyncio.run(choose_transport(FakeTrainer(trainer_uuid), gens))

    assert choose("gpu-0", ["gpu-0"], ["gpu-1", "gpu-0"]) == "cuda_ipc"
    assert choose("gpu-0", ["gpu-0"], ["gpu-1"]) == AUTO_BY_BACKEND["gloo"]  # other host
    assert choose(None, []) == AUTO_BY_BACKEND["gloo"]  # CPU


def test_auto_across_gpus_follows_the_group_backend(monkeypatch):
    """What "auto" picks without CUDA IPC is the row of AUTO_BY_BACKEND for the backend."""
    from torchtitan_rl.weight_sync import transport

    monkeypatch.setitem(transport.AUTO_BY_BACKEND, "nccl", "delta")
    monkeypatch.setitem(transport.AUTO_BY_BACKEND, "gloo", "broadcast")
    trainer = FakeTrainer("gpu-0")
    nccl = [FakeGenerator(["gpu-1"], "cuda:1")]  # a GPU of its own, not the trainer's
    gloo = [FakeGenerator([], "cpu")]
    assert asyncio.run(WeightSync.create(trainer, nccl, "bfloat16")).transport == "delta"
    assert asyncio.run(WeightSync.create(trainer, gloo, "bfloat16")).transport == "broadcast"
    assert trainer.opened == [("delta", 1, "nccl"), ("broadcast", 1, "gloo")]


@pytest.mark.parametrize("wanted", ["broadcast", "delta", "controller"])
def test_weight_sync_transport_forces_the_transport(wanted):
    gens = [FakeGenerator(["gpu-0", "gpu-1"], "cuda:1")]  # auto would pick CUDA IPC
    sync = asyncio.run(WeightSync.create(FakeTrainer("gpu-0"), gens, "bfloat16", wanted))
    assert sync.transport == wanted
    assert sync.backend == (None if wanted == "controller" else "nccl")


def test_the_broadcast_group_is_nccl_only_when_every_member_is_on_a_gpu():
    def backend(trainer_uuid, *devices):
        gens = [FakeGenerator([], d) for d in devices]
        sync = asyncio.run(WeightSync.create(FakeTrainer(trainer_uuid), gens, "float32"))
        assert not TRANSPORTS[sync.transport].relay
        return sync.backend

    assert backend("gpu-0", "cuda:1", "cuda:2") == "nccl"  # a GPU each (here: other hosts)
    assert backend("gpu-0", "cuda:0", "cuda:1") == "gloo"  # one shares the trainer's GPU
    assert backend("gpu-0", "cuda:1", "cuda:1") == "gloo"  # two generators share a GPU
    assert backend("gpu-0", "cuda:1", "cpu") == "gloo"
    assert backend(None, "cpu") == "gloo"


@pytest.mark.parametrize("transport", ["broadcast", "delta"])
def test_a_group_that_cannot_open_falls_back_to_the_controller(transport):
    trainer = FakeTrainer(None)
    refuse = trainer._open

    def open_or_refuse(key, name, *args):
        if name != "controller":
            raise OSError("no free port")
        return refuse(key, name, *args)

    trainer.weights_open = _Endpoint(open_or_refuse)
    gens = [FakeGenerator([])]
    sync = asyncio.run(WeightSync.create(trainer, gens, "float32", transport))
    assert sync.transport == "controller" and sync.backend is None
    asyncio.run(sync())
    assert gens[0].loaded == [("controller", 1), (f"payload-{sync.key}", 0)]
    assert sync.version == 3


def test_a_group_that_cannot_form_falls_back_to_the_controller():
    """An address the generators cannot reach fails while the group forms, at start."""
    trainer = FakeTrainer(None)

    def unreachable(key):
        if trainer.opened[-1][0] != "controller":
            raise RuntimeError("DistStoreError: wait timeout after 60000ms, keys: /0/1")
        return [None, None]

    trainer.weights_form = _Endpoint(unreachable)
    sync = asyncio.run(WeightSync.create(trainer, [FakeGenerator([])], "float32"))
    assert sync.transport == "controller"


def test_a_broken_broadcast_reports_the_death_a_generator_learns_of_later():
    """The trainer's gloo error comes first; the generator's call fails a moment later with
    Monarch's report of its dead host: that report is what the run says."""
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

    trainer, gens = FakeTrainer(None), [FakeGenerator([]), FakeGenerator([])]

    async def reset(key, payload):
        raise RuntimeError("gloo: Connection reset by peer")

    async def dies_later(key, payload, index):
        await asyncio.sleep(0.2)
        raise SupervisionError("generator on host generator_1: its host stopped answering")

    trainer.weights_send.call = reset
    gens[1].weights_receive.call_one = dies_later
    sync = WeightSync(trainer, gens, "float32", "broadcast")
    with pytest.raises(SupervisionError, match="host generator_1"):
        asyncio.run(sync())
    sync.peer_failure_wait_s = 0.05  # the report comes too late: the gloo error, as one line
    with pytest.raises(BroadcastBroken, match="the weight broadcast failed: .*reset by peer"):
        asyncio.run(sync())


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_every_replica_gets_every_sync(transport):
    trainer = FakeTrainer("gpu-0")
    gens = [FakeGenerator(["gpu-0"]) for _ in range(3)]
    sync = WeightSync(trainer, gens, "bfloat16", transport)
    asyncio.run(sync.open())
    asyncio.run(sync())
    asyncio.run(sync())
    # relays: the trainer's payload with each replica's own index; groups: nothing relayed
    got = [(f"payload-{sync.key}", i) if TRANSPORTS[transport].relay else (None, i)
           for i in range(3)]  # fmt: skip
    assert [g.loaded for g in gens] == [[(transport, i + 1)] + [got[i]] * 2 for i in range(3)]
    assert sync.version == 3
    asyncio.run(sync.close())
    assert trainer.closed == [sync.key]
