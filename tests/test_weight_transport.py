"""Choosing and driving a weight transport (weight_sync/transport.py) against fake actors:
CUDA IPC only when every generator sees the trainer's GPU, NCCL only when every member has a
GPU of its own, a forced transport is taken (and ends the run in one line when it cannot
open, or is refused up front where it cannot work), "auto"'s pick that cannot open falls
back to the controller with one warning line, a broken group reports the death a generator
learns of later, and every replica gets every sync (relays: with its own index)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from monarch.actor import ActorError

from torchtitan_rl.weight_sync.broadcast import BroadcastBroken
from torchtitan_rl.weight_sync.config import AUTO_BY_BACKEND, TRANSPORT_CHOICES, WeightSyncConfig
from torchtitan_rl.weight_sync.strategies import TRANSPORTS
from torchtitan_rl.weight_sync.transport import TransportUnavailable, WeightSync, choose_transport


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


def _remote(error: Exception) -> ActorError:
    """`error` as a failed actor call reports it: its text holds the remote traceback."""
    try:
        raise error
    except Exception as e:
        return ActorError(e)


def _refusing(trainer: FakeTrainer, error: Exception) -> FakeTrainer:
    """`trainer`, whose weights_open raises `error` for every transport but "controller"."""
    opens = trainer._open

    def open_or_refuse(key, name, *args):
        if name != "controller":
            raise error
        return opens(key, name, *args)

    trainer.weights_open = _Endpoint(open_or_refuse)
    return trainer


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.parametrize("transport", ["broadcast", "delta"])
def test_auto_falls_back_to_the_controller_with_one_warning_line(monkeypatch, transport):
    """With "auto", a pick that cannot open: the controller path, and one warning line
    naming why (the remote exception, not its traceback); the traceback only at DEBUG."""
    from torchtitan_rl.weight_sync import transport as module

    monkeypatch.setitem(module.AUTO_BY_BACKEND, "gloo", transport)
    trainer = _refusing(FakeTrainer(None), _remote(OSError("no free port")))
    lines = _Lines()
    module.logger.addHandler(lines)
    monkeypatch.setattr(module.logger, "level", logging.DEBUG)
    try:
        gens = [FakeGenerator([])]
        sync = asyncio.run(WeightSync.create(trainer, gens, "float32"))
    finally:
        module.logger.removeHandler(lines)
    assert sync.transport == "controller" and sync.backend is None
    asyncio.run(sync())
    assert gens[0].loaded == [("controller", 1), (f"payload-{sync.key}", 0)]
    assert sync.version == 3
    shown = [r for r in lines.records if r.levelno >= logging.INFO]
    assert [r.getMessage() for r in shown] == [
        f'weight sync: "{transport}" could not be opened (OSError: no free port); syncing '
        "through the controller (slower)"
    ]
    assert shown[0].exc_info is None
    debug = [r for r in lines.records if r.levelno == logging.DEBUG]
    assert len(debug) == 1 and debug[0].exc_info is not None


@pytest.mark.parametrize(
    "transport, error, why",
    [
        ("cuda_ipc", AssertionError("Torch not compiled with CUDA enabled"),
         "AssertionError: Torch not compiled with CUDA enabled"),
        ("broadcast", OSError("no free port"), "OSError: no free port"),
        ("delta", RuntimeError("DistStoreError: wait timeout\nkeys: /0/1"),
         "RuntimeError: DistStoreError: wait timeout"),
    ],
)  # fmt: skip
def test_a_transport_set_by_name_that_cannot_open_ends_the_run_in_one_line(transport, error, why):
    """No quiet fall back to the slowest path: one line naming weight_sync.transport, the
    remote exception and the valid values; the CLI prints it as it is (train.one_line)."""
    from torchtitan_rl.train import one_line

    trainer = _refusing(FakeTrainer(None), _remote(error))
    with pytest.raises(TransportUnavailable) as caught:
        asyncio.run(WeightSync.create(trainer, [FakeGenerator([])], "float32", transport))
    others = ", ".join(f'"{t}"' for t in TRANSPORT_CHOICES if t != transport)
    assert str(caught.value) == (
        f'weight_sync.transport = "{transport}" could not be opened ({why}); valid: {others} '
        '("auto" falls back to "controller" when its pick cannot open)'
    )
    assert one_line(caught.value) == str(caught.value)
    assert trainer.opened == []  # not reopened through the controller


def test_a_death_while_a_named_transport_opens_is_reported_as_the_death():
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

    trainer = _refusing(FakeTrainer(None), SupervisionError("generator_0: its process died"))
    with pytest.raises(SupervisionError, match="its process died"):
        asyncio.run(WeightSync.create(trainer, [FakeGenerator([])], "float32", "broadcast"))


@pytest.mark.parametrize(
    "on_gpus, one_host, why",
    [
        (False, True, "this run is on CPU"),
        (True, False, "this run puts them on hosts of their own"),
    ],
)
def test_cuda_ipc_set_by_name_is_refused_where_it_cannot_work(on_gpus, one_host, why):
    """Before any process starts (preflight): CUDA IPC needs trainer rank 0 and every
    generator on GPUs of one host; every other choice is valid on any run."""
    with pytest.raises(ValueError) as caught:
        WeightSyncConfig(transport="cuda_ipc").check_run(on_gpus=on_gpus, one_host=one_host)
    assert str(caught.value) == (
        'weight_sync.transport = "cuda_ipc" needs trainer rank 0 and every generator on GPUs '
        f'of one host, and {why}; valid here: "auto", "broadcast", "delta", "controller"'
    )
    WeightSyncConfig(transport="cuda_ipc").check_run(on_gpus=True, one_host=True)
    for choice in TRANSPORT_CHOICES:
        if choice != "cuda_ipc":
            WeightSyncConfig(transport=choice).check_run(on_gpus=False, one_host=False)


def test_preflight_refuses_cuda_ipc_for_a_monarch_job():
    """launcher.kind = "kubernetes" (set after loading: its client need not be installed
    here): the generators run on hosts of their own."""
    from test_config import TINY

    from torchtitan_rl.config import load_config
    from torchtitan_rl.controller.preflight import check_machine

    config = load_config(TINY, ["--weight_sync.transport=cuda_ipc"])
    config.launcher.kind = "kubernetes"
    with pytest.raises(ValueError, match="this run puts them on hosts of their own"):
        check_machine(config)
    config.weight_sync.transport = "broadcast"
    assert check_machine(config) is None


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
