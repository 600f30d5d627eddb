"""Weight sync: the on-device gather equals the CPU packing bit for bit, the transport is
chosen from which GPUs the processes see, every replica gets its own IPC handle, and (on a
GPU) every generator holds the trainer's weights bit for bit after a CUDA IPC sync."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.models.qwen3 import ModelConfig
from torchtitan_rl.training.trainer import TrainerCore
from torchtitan_rl.training.trainer_config import TrainingConfig
from torchtitan_rl.training.weight_sync import (
    SharedWeights,
    gather_into,
    make_layout,
    pack_weights,
    sharded_state,
    unpack_weights,
)
from torchtitan_rl.weight_transport import WeightSync, WeightTransport, choose_transport

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_into_equals_packing_the_full_state_dict_under_fsdp(dtype):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        core = TrainerCore(
            model_config=ModelConfig(max_seq_len=64),
            training=TrainingConfig(),
            loss=LossConfig(),
            correction=CorrectionConfig(),
            vocab_size=96,
            device=torch.device("cpu"),
            seed=0,
        )
        state = sharded_state(core.model)
        assert any(isinstance(t, DTensor) for t in state.values()), "FSDP shards gathered"
        expected = pack_weights(core.full_state_dict(), version=0, dtype=dtype)
        layout, numel = make_layout(state)
        flat_P = torch.full((numel,), float("nan"), dtype=dtype)
        gather_into(state, flat_P)
    finally:
        dist.destroy_process_group()
    assert layout == expected.layout
    assert torch.equal(flat_P, expected.flat_P)


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
        self.share_weights = _Endpoint(self._share)
        self.publish_weights = _Endpoint(
            lambda dtype: [pack_weights({"w": torch.ones(2)}, self.version), None]
        )

    def _share(self, dtype, receivers):
        handles = [{"storage_handle": b"h", "receiver": i} for i in range(receivers)]
        return [
            SharedWeights(version=self.version, layout=[], device_uuid="gpu-0", handles=handles),
            None,
        ]


class FakeGenerator:
    def __init__(self, uuids):
        self.cuda_uuids = _Endpoint(lambda: uuids)
        self.loaded = []
        self.load_shared_weights = _Endpoint(
            lambda shared, i: self.loaded.append(("ipc", shared.handles[i]["receiver"]))
        )
        self.load_weights = _Endpoint(lambda packed: self.loaded.append(("packed", packed.version)))


def test_cuda_ipc_only_when_every_generator_sees_the_trainer_gpu():
    def choose(trainer_uuid, *generator_uuids):
        gens = [FakeGenerator(u) for u in generator_uuids]
        return asyncio.run(choose_transport(FakeTrainer(trainer_uuid), gens))

    assert choose("gpu-0", ["gpu-0"], ["gpu-1", "gpu-0"]) is WeightTransport.CUDA_IPC
    assert choose("gpu-0", ["gpu-0"], ["gpu-1"]) is WeightTransport.CONTROLLER  # other host
    assert choose(None, []) is WeightTransport.CONTROLLER  # CPU


@pytest.mark.parametrize("transport", list(WeightTransport))
def test_every_replica_gets_the_weights_and_its_own_handle(transport):
    gens = [FakeGenerator(["gpu-0"]) for _ in range(3)]
    sync = WeightSync(FakeTrainer("gpu-0"), gens, "bfloat16", transport)
    asyncio.run(sync())
    asyncio.run(sync())
    if transport is WeightTransport.CUDA_IPC:
        assert [g.loaded for g in gens] == [[("ipc", i)] * 2 for i in range(3)]
    else:
        assert [g.loaded for g in gens] == [[("packed", 3)] * 2] * 3


async def _ipc_scenario(config):
    from torchtitan_rl.controller import Controller

    controller = Controller(config, use_tqdm=False)
    try:
        await controller.start()  # the first sync
        await controller.warm_start()  # optimizer steps, then a second sync into the same buffer
        out = await controller.trainer.publish_weights.call(config.generator.dtype)
        packed = [p for p in out.values() if p is not None][0]
        return dict(
            transport=controller.weight_sync.transport,
            trainer=unpack_weights(packed),
            version=packed.version,
            generators=[await g.weights.call_one() for g in controller.generators],
            versions=[await g.policy_version.call_one() for g in controller.generators],
        )
    finally:
        await controller.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_generators_hold_the_trainer_weights_bit_for_bit_after_a_cuda_ipc_sync(tmp_path):
    from torchtitan_rl.config import load_config

    config = load_config(
        ROOT / "train_configs" / "alphabet_sort_tiny.toml",
        [
            f"--job.output_dir={tmp_path}",
            "--parallelism.device=cuda",
            "--parallelism.trainer_procs=1",
            "--warm_start.steps=2",
            "--warm_start.batch_size=4",
            "--generator.dtype=bfloat16",
            "--generator.num_replicas=2",
            "--generator.max_num_seqs=4",
            "--generator.cuda_graphs=false",
        ],
    )
    r = asyncio.run(_ipc_scenario(config))
    assert r["transport"] is WeightTransport.CUDA_IPC
    assert r["version"] == 2 and r["versions"] == [2, 2]
    for weights in r["generators"]:
        assert sorted(weights) == sorted(r["trainer"])
        for name, t in r["trainer"].items():
            assert weights[name].dtype == t.dtype == torch.bfloat16
            assert torch.equal(weights[name], t), name
