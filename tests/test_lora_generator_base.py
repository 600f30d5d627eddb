"""`lora.generator_base`: where a native generator keeps the frozen base it merges each
version's adapters into. "device" copies the adapted weights' base to the device once and
lets the received base go; "host" keeps it in (page-locked) host memory and copies it over
at every merge; "auto" keeps it on the GPU where it fits. The merges are the same bits."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_engine import make_engine, tiny_qwen3
from test_lora import one_rank  # noqa: F401 (a fixture)
from test_lora_sync import _adapters, _assert_holds_full_sync, _generator, _step, _trainer
from test_weight_sync_members import _Mesh

from torchtitan_rl.config.loader import ConfigError, load_config
from torchtitan_rl.weight_sync.lora_sync import LoRABase, base_fits_on_device
from torchtitan_rl.weight_sync.packing import pack_weights
from torchtitan_rl.weight_sync.sides import ReceivingSide
from torchtitan_rl.weight_sync.transport import WeightSync

GIB = 2**30


def _merge_twice(placement: str, device: str = "cpu"):
    """Two versions merged by a LoRABase kept per `placement` and loaded into an engine;
    (the LoRABase, the engine's weights after each version)."""
    base = {k: v.to(device) for k, v in tiny_qwen3().state_dict().items()}
    packed = pack_weights(base, 0)
    lora = LoRABase(packed, base_id=9, device=device, placement=placement)
    del packed
    engine, held = make_engine(), []
    for version, seed in ((1, 1), (2, 2)):
        adapters, _ = _adapters(version, seed=seed)
        state, partial = lora.merge(adapters, torch.float32)
        engine.load_weights(state, version, partial=partial)
        del state
        held.append({k: v.clone() for k, v in engine.model_parameters()})
    return lora, held


def test_device_keeps_only_the_adapted_base_and_merges_the_bits_of_host():
    on_host, host_held = _merge_twice("host")
    on_device, device_held = _merge_twice("device")
    assert (on_host.on_device, on_device.on_device) == (False, True)
    for host_weights, device_weights in zip(host_held, device_held):
        assert host_weights.keys() == device_weights.keys()
        for name, w in host_weights.items():
            assert torch.equal(device_weights[name], w), name
    # host: the whole base as received, for the run; the merges read views of it
    flat = on_host.host.flat_P
    assert on_host.nbytes() == flat.numel() * flat.element_size()
    assert all(t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for t in on_host.adapted.values())  # fmt: skip
    # device: one buffer of the adapted weights' base; the received base is gone
    assert on_device.host is None and on_device.nbytes() == on_device.adapted_nbytes()
    (storage,) = {t.untyped_storage().data_ptr() for t in on_device.adapted.values()}
    assert on_device.adapted_nbytes() == on_host.adapted_nbytes() < on_host.nbytes()
    assert len(on_device.adapted) == 4 and storage != flat.untyped_storage().data_ptr()


@pytest.mark.parametrize("placement", ["host", "device", "auto"])
@pytest.mark.usefixtures("one_rank")
def test_every_placement_delivers_the_full_merged_weights_bit_for_bit(placement):
    trainer, gen = _trainer(alpha=8.0, rank=3), _generator()
    gen.sync_side = ReceivingSide(gen.device, base_placement=placement)

    async def run_syncs():
        sync = await WeightSync.create(_Mesh(trainer), [_Mesh(gen)], "float32", "controller")
        for k in range(3):
            if k:
                _step(trainer, seed=k)
            await sync()
            _assert_holds_full_sync(gen, trainer, "float32")
        await sync.close()

    asyncio.run(run_syncs())
    assert gen.sync_side.lora.on_device is (placement != "host")  # CPU: "auto" is "device"


@pytest.mark.parametrize(
    ("need_gib", "free_gib", "cap_gib", "peak_gib", "fits"),
    [
        (0.9, 130.0, 0.0, 6.6, True),  # 0.6B, uncapped H200 shared with the trainer
        (7.2, 100.0, 37.0, 22.3, True),  # 4B, 37 GiB each on an H200
        (13.6, 40.0, 37.25, 36.25, False),  # 8B, 80 GB split in two: over the cap
        (13.6, 20.0, 0.0, 23.0, False),  # uncapped: more than half of what is free
    ],
)
def test_auto_keeps_the_base_on_the_gpu_where_it_fits(need_gib, free_gib, cap_gib, peak_gib, fits):
    got = base_fits_on_device(
        int(need_gib * GIB), free=int(free_gib * GIB), cap=int(cap_gib * GIB),
        peak=int(peak_gib * GIB),
    )  # fmt: skip
    assert got is fits


def test_generator_base_mistakes_name_the_key_and_its_values():
    with pytest.raises(ConfigError, match="lora.generator_base must be one of"):
        load_config("train_configs/alphabet_sort_tiny.toml", ["--lora.generator_base=gpu"])


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["host", "device"])
def test_on_a_gpu_device_holds_the_adapted_base_there_and_host_holds_none(placement):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.ones(8, 8, device="cuda")
    x @ x  # cuBLAS's workspace (32 MiB on an H200) is allocated at the first GEMM: not kept
    before = torch.cuda.memory_allocated()
    lora, held = _merge_twice(placement, device="cuda")
    kept = torch.cuda.memory_allocated() - before
    if placement == "device":
        assert lora.host is None and kept >= lora.adapted_nbytes()
        assert {t.device.type for t in lora.adapted.values()} == {"cuda"}
    else:
        assert lora.host.locked and kept < lora.adapted_nbytes()
        assert {t.device.type for t in lora.adapted.values()} == {"cpu"}
    _, cpu_held = _merge_twice("host")
    for got, want in zip(held, cpu_held):
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=0, atol=1e-5)
