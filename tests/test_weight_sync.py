"""Weight sync: the on-device gather equals the CPU packing bit for bit, a tied weight is
packed once, the batched copy equals the per-tensor gather, a broadcast delivers the buffer
bit for bit, and (on a GPU) every generator holds the trainer's weights bit for bit after a
CUDA IPC sync. The choice of transport: tests/test_weight_transport.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.models import qwen3
from torchtitan_rl.models.qwen3 import ModelConfig, build_model
from torchtitan_rl.training.trainer import TrainerCore
from torchtitan_rl.training.trainer_config import TrainingConfig
from torchtitan_rl.weight_sync import packing
from torchtitan_rl.weight_sync.packing import (
    gather_into,
    make_layout,
    pack_weights,
    sharded_state,
    unpack_weights,
)

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 96
TIED = ("tok_embeddings.weight", "output.weight")


@pytest.fixture
def one_rank():
    """A one-rank gloo group, so TrainerCore shards its model with FSDP (DTensors)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tiny_core(tp: int = 1) -> TrainerCore:
    """The tiny policy on CPU (tied if `qwen3.BUILTIN_ARGS["tiny"]` says so), with weights
    that bf16 rounds."""
    return TrainerCore(
        model_config=ModelConfig(max_seq_len=64),
        training=TrainingConfig(),
        loss=LossConfig(),
        correction=CorrectionConfig(),
        vocab_size=VOCAB,
        device=torch.device("cpu"),
        seed=0,
        tp=tp,
    )


def _core(monkeypatch, tied: bool) -> TrainerCore:
    """The tiny policy, tied like Qwen3 0.6B when `tied`."""
    args = {**qwen3.TINY_ARGS, "enable_weight_tying": tied}
    monkeypatch.setitem(qwen3.BUILTIN_ARGS, "tiny", args)
    return _tiny_core()


def _loop_packing(state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The reference: one copy per name at its layout offset (tied names write twice)."""
    layout, numel = make_layout(state)
    flat_P = torch.full((numel,), float("nan"), dtype=dtype)
    for name, _, start in layout:
        t = state[name]
        full = t.full_tensor() if isinstance(t, DTensor) else t
        flat_P[start : start + full.numel()].copy_(full.reshape(-1))
    return flat_P


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_into_equals_packing_the_full_state_dict_under_fsdp(
    one_rank, monkeypatch, dtype, tied
):
    core = _core(monkeypatch, tied)
    state = sharded_state(core.model)
    assert any(isinstance(t, DTensor) for t in state.values()), "FSDP shards gathered"
    full = core.full_state_dict()
    layout, numel = make_layout(state)
    flat_P = torch.full((numel,), float("nan"), dtype=dtype)
    gather_into(state, flat_P)
    assert [(n, s) for n, s, _ in layout] == [(n, tuple(t.shape)) for n, t in full.items()]
    assert torch.equal(flat_P, _loop_packing(full, dtype))
    offsets = {name: start for name, _, start in layout}
    embedding = VOCAB * qwen3.TINY_ARGS["dim"]
    total = sum(t.numel() for t in full.values())
    if tied:
        assert offsets[TIED[0]] == offsets[TIED[1]] and numel == total - embedding
    else:
        assert offsets[TIED[0]] != offsets[TIED[1]] and numel == total
        assert layout == pack_weights(full, version=0, dtype=dtype).layout


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 3)
        self.norm = nn.LayerNorm(3, bias=False)
        self.head = nn.Linear(3, 7, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weight_is_packed_once_and_unpacks_as_two_views_of_it():
    model = _Tied()
    state = model.state_dict()  # detached entries: distinct objects, one storage
    assert state["embed.weight"] is not state["head.weight"]
    packed = pack_weights(state, version=1, dtype=torch.bfloat16)
    assert packed.flat_P.numel() == 7 * 3 + 3
    back = unpack_weights(packed)
    assert back["embed.weight"].data_ptr() == back["head.weight"].data_ptr()
    for name in ("embed.weight", "head.weight", "norm.weight"):
        assert torch.equal(back[name], state[name].to(torch.bfloat16)), name


def test_views_of_one_storage_alias_only_when_they_are_the_same_view():
    base = torch.randn(12)
    state = {"a": base[:6], "same": base[:6].view(6), "b": base[6:], "a4": base[:4]}
    layout, numel = make_layout(state)
    offsets = {name: start for name, _, start in layout}
    assert offsets["same"] == offsets["a"]
    assert len({offsets["a"], offsets["b"], offsets["a4"]}) == 3 and numel == 6 + 6 + 4
    back = unpack_weights(pack_weights(state, version=0))
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_copy_equals_the_per_tensor_loop_for_plain_tensors(dtype):
    torch.manual_seed(0)
    state = {"w": torch.randn(5, 3), "t": torch.randn(3, 4).t(), "b": torch.randn(7)}
    layout, numel = make_layout(state)
    flat_P = torch.full((numel,), float("nan"), dtype=dtype)
    gather_into(state, flat_P)
    assert torch.equal(flat_P, _loop_packing(state, dtype))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_packs_without_gathers_and_equals_the_gather_path(
    one_rank, monkeypatch, dtype, tied
):
    state = sharded_state(_core(monkeypatch, tied).model)
    layout, numel = make_layout(state)
    gathered = []

    def counted_full_tensor(self):
        gathered.append(self)
        return DTensor.to_local(self).clone()  # a one-rank mesh: the shard is the tensor

    gather_rows = packing._gather_rows

    def counted_gather_rows(t):
        gathered.append(t)
        return gather_rows(t)

    fast_P = torch.full((numel,), float("nan"), dtype=dtype)
    with monkeypatch.context() as m:
        m.setattr(DTensor, "full_tensor", counted_full_tensor)
        m.setattr(packing, "_gather_rows", counted_gather_rows)
        gather_into(state, fast_P)
        assert gathered == [], "one rank: nothing to gather"
        m.setattr(packing, "_is_whole", lambda t: not isinstance(t, DTensor))
        loop_P = torch.full((numel,), float("nan"), dtype=dtype)
        gather_into(state, loop_P)
    assert len(gathered) == len(state) - tied, "the gather path gathers each tensor once"
    assert torch.equal(fast_P, loop_P)
    assert torch.equal(fast_P, _loop_packing(state, dtype))


def _publish(core: TrainerCore, dtype: str, rank: int = 0):
    """The trainer actor's `publish_weights` endpoint, run on a bare actor (no Monarch)."""
    from torchtitan_rl.actors.trainer import TrainerActor

    actor = TrainerActor.__new__(TrainerActor)
    actor.rank, actor.core = rank, core
    return asyncio.run(TrainerActor.__dict__["publish_weights"]._method(actor, dtype))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_publish_weights_round_trips_the_full_state_dict_in_the_dtype(
    one_rank, monkeypatch, dtype, tied
):
    core = _core(monkeypatch, tied)
    packed = _publish(core, dtype)
    assert _publish(core, dtype, rank=1) is None
    want = getattr(torch, dtype)
    assert packed.flat_P.device.type == "cpu" and packed.flat_P.dtype == want
    back, full = unpack_weights(packed), core.full_state_dict()
    assert list(back) == list(full)
    for name, t in full.items():
        assert torch.equal(back[name], t.to(want)), name
    if tied:
        assert back[TIED[0]].data_ptr() == back[TIED[1]].data_ptr()


def _two_rank_worker(rank, port, queue):
    """Rank 0 packs, rank 1 joins the gathers; both then build torch's full state dict."""
    try:
        torch.set_num_threads(1)
        qwen3.BUILTIN_ARGS["tiny"] = {**qwen3.TINY_ARGS, "enable_weight_tying": True}
        out = {}
        for i, tp in enumerate((1, 2)):  # FSDP over two ranks; then TP=2 (_StridedShard)
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port + i}", rank=rank, world_size=2
            )
            core = _tiny_core(tp)
            state = sharded_state(core.model)
            if rank == 0:
                packed = pack_weights(state, 0, torch.bfloat16)
            else:
                gather_into(state, None)
            full = core.full_state_dict()
            dist.destroy_process_group()
            if rank == 0:  # compared here: tensors do not survive this process in a queue
                back = unpack_weights(packed)
                out[tp] = dict(
                    numel=packed.flat_P.numel(),
                    distinct=sum(t.numel() for k, t in full.items() if k != "output.weight"),
                    names=(list(back), list(full)),
                    differ=[k for k, t in full.items() if not torch.equal(back[k], t.bfloat16())],
                )
        queue.put((rank, out))
    except Exception:
        import traceback

        queue.put((rank, traceback.format_exc()))


def test_two_ranks_pack_the_full_weights_once_under_fsdp_and_tp():
    """Two gloo ranks, tied tiny model: what rank 0 packs from the shards equals torch's full
    state dict cast to bf16, bit for bit, with the tied weight stored once."""
    from fakes import run_two_ranks

    results = run_two_ranks(_two_rank_worker, ports=2, timeout=300)
    assert sorted(results[0]) == [1, 2]
    for tp, r in results[0].items():
        assert r["numel"] == r["distinct"], tp
        assert r["names"][0] == r["names"][1], tp
        assert r["differ"] == [], tp


def test_a_tied_generator_applies_aliased_weights(one_rank, monkeypatch):
    trainer = _core(monkeypatch, tied=True)
    packed = _publish(trainer, "float32")
    torch.manual_seed(1)  # other initial weights than the trainer's
    model = build_model(ModelConfig(max_seq_len=64), VOCAB, torch.device("cpu"))
    assert model.output.weight is model.tok_embeddings.weight
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_seq_len=64), "cpu")
    engine.load_weights(unpack_weights(packed), packed.version)
    full = trainer.full_state_dict()
    params = dict(model.named_parameters(remove_duplicate=False))
    assert model.output.weight is model.tok_embeddings.weight
    for name, t in full.items():
        assert torch.equal(params[name], t), name


async def _ipc_scenario(config):
    from torchtitan_rl.controller.loop import Controller

    controller = Controller(config, use_tqdm=False)
    try:
        await controller.start()  # the first sync
        await controller.warm_start()  # optimizer steps, then a second sync into the same buffer
        # reference: torch's full state dict, not our packing path
        out = await controller.trainer.full_weights.call(config.generator.dtype)
        return dict(
            transport=controller.fleet.weight_sync.transport,
            trainer=[w for w in out.values() if w is not None][0],
            generators=[await g.weights.call_one() for g in controller.fleet.actors],
            versions=[await g.policy_version.call_one() for g in controller.fleet.actors],
        )
    finally:
        await controller.close()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "trainer_procs, replicas",
    [
        (1, 2),  # one trainer rank, two generator replicas: one handle each
        (2, 1),  # FSDP over two GPUs: rank 1 takes part in the gather, rank 0 shares
    ],
)
def test_generators_hold_the_trainer_weights_bit_for_bit_after_a_cuda_ipc_sync(
    tmp_path, trainer_procs, replicas
):
    from torchtitan_rl.config import load_config

    if torch.cuda.device_count() < trainer_procs:
        pytest.skip(f"needs {trainer_procs} CUDA device(s)")
    config = load_config(
        ROOT / "train_configs" / "alphabet_sort_tiny.toml",
        [
            f"--job.output_dir={tmp_path}",
            "--parallelism.device=cuda",
            f"--parallelism.trainer_procs={trainer_procs}",
            "--warm_start.steps=2",
            "--warm_start.batch_size=4",
            "--generator.dtype=bfloat16",
            f"--generator.num_replicas={replicas}",
            "--generator.max_num_seqs=4",
            "--generator.cuda_graphs=false",
        ],
    )
    r = asyncio.run(_ipc_scenario(config))
    assert r["transport"] == "cuda_ipc"
    assert r["versions"] == [2] * replicas  # two syncs: start, end of warm start
    for weights in r["generators"]:
        assert sorted(weights) == sorted(r["trainer"])
        for name, t in r["trainer"].items():
            assert weights[name].dtype == t.dtype == torch.bfloat16
            assert torch.equal(weights[name], t), name


@pytest.mark.parametrize(
    "dtype, devices",
    [
        (torch.float32, ["cpu"] * 3),
        (torch.bfloat16, ["cpu"] * 3),
        pytest.param(torch.bfloat16, ["cuda:0", "cuda:1"], marks=pytest.mark.gpu),
    ],
)
def test_a_broadcast_delivers_the_version_and_the_buffer_bit_for_bit(dtype, devices):
    """The sender and its receivers in one process (threads): each receiver gets the
    sender's buffer in its own memory, version included, twice over one group: gloo with two
    receivers on CPU, NCCL from GPU 0 to one receiver on GPU 1 (two ranks of one NCCL
    group cannot share a GPU)."""
    import threading

    from torchtitan_rl.weight_sync.broadcast import BroadcastReceiver, BroadcastSender

    if devices[0] != "cpu" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    state = {"w": torch.randn(300, 7, device=devices[0]), "b": torch.randn(11, device=devices[0])}
    layout, numel = make_layout(state)
    sender = BroadcastSender(layout, numel, dtype, len(devices) - 1, torch.device(devices[0]))
    receivers = [
        BroadcastReceiver(sender.group, rank, torch.device(d))
        for rank, d in enumerate(devices[1:], 1)
    ]
    forming = [threading.Thread(target=r.form) for r in receivers]  # every member at once
    for t in forming:
        t.start()
    sender.form()
    for t in forming:
        t.join()
    for version in (4, 5):
        gather_into(state, sender.flat_P)
        got = [None] * len(receivers)

        def receive(i, got=got):
            got[i] = receivers[i].receive_blocking()

        threads = [threading.Thread(target=receive, args=(i,)) for i in range(len(receivers))]
        for t in threads:
            t.start()
        sender.send(version)
        for t in threads:
            t.join(timeout=60)
        for packed in got:
            assert packed.version == version and packed.layout == layout
            assert packed.flat_P.data_ptr() != sender.flat_P.data_ptr()
            assert packed.flat_P.device == torch.device(devices[-1])  # the receiver's own
            back = unpack_weights(packed)
            assert all(torch.equal(back[k].cpu(), v.to(dtype).cpu()) for k, v in state.items())
        state = {k: v + 1 for k, v in state.items()}


def test_two_receives_in_flight_on_one_generator_take_whole_syncs_in_turn():
    """A second receive posted before the first returned must not pair its version with the
    other's buffer (gloo would abort the process on the size mismatch)."""
    import threading

    from torchtitan_rl.weight_sync.broadcast import BroadcastReceiver, BroadcastSender

    layout, numel = make_layout({"w": torch.zeros(5, 3)})
    sender = BroadcastSender(layout, numel, torch.float32, receivers=1)
    receiver = BroadcastReceiver(sender.group, 1)
    forming = threading.Thread(target=receiver.form)
    forming.start()
    sender.form()
    forming.join()
    got = []
    threads = [threading.Thread(target=lambda: got.append(receiver.receive_blocking()))
               for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for version in (1, 2):
        sender.flat_P.fill_(float(version))
        sender.send(version)
    for t in threads:
        t.join(timeout=30)
    assert sorted((p.version, float(p.flat_P[0]), float(p.flat_P[-1])) for p in got) == [
        (1, 1.0, 1.0), (2, 2.0, 2.0)]  # fmt: skip
