"""Adapter-only weight sync ([lora] on, native engine): the actors' real endpoint code over
real transports (each actor a bare instance, its calls in threads of their own: the members
test's `_Mesh`), a real TrainerCore with adapters and a real Engine. After k adapter-only
syncs the engine's weights are bit for bit those of a full merged sync and its log-probs the
trainer's; each sync packs the adapters alone; a fresh replica gets the base first; and a
request admitted after an adapter version never reuses KV blocks of the version before."""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch
from fakes import TRAINER_VOCAB
from test_engine import GREEDY, make_engine, prompt, run, tiny_qwen3, yield_loop
from test_engine_paged import clean_run_on
from test_lora import _one_row, _publish, lora_core, one_rank  # noqa: F401 (a fixture)
from test_weight_sync_members import _Mesh

from torchtitan_rl.actors.generator import GeneratorActor
from torchtitan_rl.actors.trainer import TrainerActor
from torchtitan_rl.device import DTYPES
from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import AdapterUse, EngineConfig
from torchtitan_rl.models.lora import lora_modules
from torchtitan_rl.models.qwen3 import ModelConfig, build_model
from torchtitan_rl.types import SamplingParams
from torchtitan_rl.weight_sync.lora_sync import SCALE, LoRABase, Payload, adapter_payload
from torchtitan_rl.weight_sync.packing import pack_weights, unpack_weights
from torchtitan_rl.weight_sync.sides import ReceivingSide, SendingSide
from torchtitan_rl.weight_sync.transport import WeightSync


def _trainer(**lora) -> TrainerActor:
    actor = TrainerActor.__new__(TrainerActor)
    actor.rank, actor.core = 0, lora_core(**lora)
    actor.sync_side = SendingSide(actor.core.device)
    return actor


def _generator(dtype: str = "float32", seed: int = 7) -> GeneratorActor:
    """A native engine built from another init: every weight it computes with must come
    from the syncs."""
    actor = GeneratorActor.__new__(GeneratorActor)
    torch.manual_seed(seed)
    model = build_model(ModelConfig(max_seq_len=64), TRAINER_VOCAB, torch.device("cpu"))
    config = EngineConfig(max_num_seqs=2, max_seq_len=64, dtype=dtype)
    actor.engine = Engine(model, config, "cpu")
    actor.device = torch.device("cpu")
    actor.sync_side = ReceivingSide(actor.device)
    actor.actor_name = "generator"
    return actor


@torch.no_grad()
def _step(trainer: TrainerActor, seed: int) -> None:
    """An optimizer step's worth of change to every A and B (B leaves zero)."""
    g = torch.Generator().manual_seed(seed)
    for _, m in lora_modules(trainer.core.model):
        for p in (m.lora_A, m.lora_B):
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(0.05 * torch.randn(local.shape, generator=g))
    trainer.core.policy_version += 1


def _adapter_bytes(trainer: TrainerActor) -> int:
    """A and B of every adapted projection in fp32, plus the 4-byte scale."""
    sizes = [m.lora_A.numel() + m.lora_B.numel() for _, m in lora_modules(trainer.core.model)]
    return 4 * sum(sizes) + 4


def _full_sync(trainer: TrainerActor, dtype: str) -> dict[str, torch.Tensor]:
    """What a full merged sync delivers, as the engine holds it (its dtype)."""
    packed = pack_weights(trainer.core.sync_state(), 0, DTYPES[dtype])  # `publish_weights`
    return {k: v.to(DTYPES[dtype]) for k, v in unpack_weights(packed).items()}


def _assert_holds_full_sync(generator: GeneratorActor, trainer: TrainerActor, dtype: str):
    want = _full_sync(trainer, dtype)
    got = dict(generator.engine.model_parameters())
    assert generator.engine.policy_version == trainer.core.policy_version
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize(
    ("transport", "dtype"),
    [("controller", "float32"), ("broadcast", "float32"), ("controller", "bfloat16")],
)
@pytest.mark.usefixtures("one_rank")  # FSDP on one rank: the trainer's state is DTensors
def test_adapter_syncs_deliver_the_full_merged_weights_bit_for_bit(transport, dtype):
    trainer, gen = _trainer(alpha=8.0, rank=3), _generator(dtype)  # scale 8/3: not exact
    steps = 3

    async def run_syncs():
        sync = await WeightSync.create(_Mesh(trainer), [_Mesh(gen)], dtype, transport)
        assert (sync.transport, sync.payload, sync.base_sent_to) == (
            transport, Payload.ADAPTERS, 1,
        )  # fmt: skip
        sizes = []
        for k in range(steps + 1):
            if k:
                _step(trainer, seed=k)
            await sync()
            sizes.append(trainer.sync_side.last_bytes)
            _assert_holds_full_sync(gen, trainer, dtype)
        await sync.close()
        return sizes

    sizes = asyncio.run(run_syncs())
    full = _publish(trainer.core, dtype).nbytes
    assert sizes == [_adapter_bytes(trainer)] * (steps + 1)
    assert 10 * sizes[0] < full  # tiny shape, rank 3; 0.6B at rank 8: docs/benchmarks.md

    if dtype == "float32":  # the engine's log-probs are the trainer's
        prompt_ids = np.arange(5, dtype=np.int32)
        sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=3)

        async def generate():
            out = await gen.engine.generate(prompt_ids, request_id="r", sampling=sampling)
            await gen.engine.close()
            return out

        out = asyncio.run(generate())
        t = _one_row(np.concatenate([prompt_ids, out.token_ids_N]), len(prompt_ids))
        with torch.no_grad():
            trainer_N = trainer.core._logprobs(t, 1.0)[0]
        np.testing.assert_allclose(out.logprobs_N, trainer_N.numpy(), atol=1e-5)


@pytest.mark.parametrize("transport", ["controller", "broadcast"])
def test_a_fresh_replica_gets_the_base_first_and_a_survivor_keeps_its_own(transport):
    trainer, survivor, lost = _trainer(), _generator(), _generator()
    t = _Mesh(trainer)

    async def run_syncs():
        first = await WeightSync.create(t, [_Mesh(survivor), _Mesh(lost)], "float32", transport)
        await first()
        assert first.base_sent_to == 2
        lost.sync_side.close()  # the replica dies; a fresh one replaces it
        await first.close()
        fresh = _generator(seed=11)
        with pytest.raises(RuntimeError, match="the base must be sent first"):
            await fresh.sync_side.join("k", transport, None, 1, Payload.ADAPTERS, 5)
        _step(trainer, seed=1)
        both = await WeightSync.create(t, [_Mesh(survivor), _Mesh(fresh)], "float32", transport)
        assert (both.payload, both.base_sent_to) == (Payload.ADAPTERS, 1)
        for k in range(2):
            await both()
            assert trainer.sync_side.last_bytes == _adapter_bytes(trainer)
            _assert_holds_full_sync(survivor, trainer, "float32")
            _assert_holds_full_sync(fresh, trainer, "float32")
            _step(trainer, seed=2 + k)
        await both.close()
        assert (
            survivor.sync_side.held_base == fresh.sync_side.held_base == trainer.sync_side.base_id
        )

    asyncio.run(run_syncs())


def test_without_lora_or_with_a_full_weights_backend_every_sync_is_full():
    trainer, gen = _trainer(), _generator()
    gen.sync_side.adapter_use = AdapterUse.FULL  # vLLM with lora.vllm_sync = "merged"

    async def open_sync():
        return await WeightSync.create(_Mesh(trainer), [_Mesh(gen)], "float32", "controller")

    sync = asyncio.run(open_sync())
    assert (sync.payload, sync.base_sent_to) == (Payload.FULL, 0)


class _Recording:
    """An engine that serves adapters itself (`AdapterUse.SERVE`): records each load."""

    adapter_use = AdapterUse.SERVE

    def __init__(self):
        self.loaded: list[tuple[int, dict[str, torch.Tensor], bool]] = []
        self.config = EngineConfig()

    def load_weights(self, state, version, partial=False):
        self.loaded.append((version, {k: v.clone() for k, v in state.items()}, partial))


@pytest.mark.parametrize("transport", ["controller", "broadcast"])
def test_an_engine_serving_adapters_gets_the_base_with_the_first_adapters_then_adapters_alone(
    transport,
):
    """lora.vllm_sync = "adapters": the base moves once, and reaches the engine together with
    the first adapters (one load: never the base alone, which no version is); each later
    sync loads only that version's A, B and scale, the bytes of the adapters; the generator
    keeps nothing of the base once the engine has it."""
    trainer, gen = _trainer(alpha=8.0, rank=3), _generator()
    gen.engine = _Recording()
    gen.sync_side = ReceivingSide(gen.device, AdapterUse.SERVE)

    async def run_syncs():
        sync = await WeightSync.create(_Mesh(trainer), [_Mesh(gen)], "float32", transport)
        assert (sync.payload, sync.base_sent_to) == (Payload.ADAPTERS, 1)
        for k in range(3):
            if k:
                _step(trainer, seed=k)
            await sync()
            assert trainer.sync_side.last_bytes == _adapter_bytes(trainer)
        await sync.close()

    asyncio.run(run_syncs())
    full = trainer.core.full_state_dict(merged=False)
    base = {k: v for k, v in full.items() if ".lora_" not in k}
    assert [(v, p) for v, _, p in gen.engine.loaded] == [(0, False), (1, True), (2, True)]
    for (_, state, _), k in zip(gen.engine.loaded, range(3)):
        adapters = {n: s for n, s in state.items() if n == SCALE or ".lora_" in n}
        assert float(adapters.pop(SCALE)) == float(torch.tensor(8.0 / 3))  # sent in fp32
        assert len(adapters) == 2 * len(list(lora_modules(trainer.core.model)))  # A and B
        assert set(state) - set(adapters) - {SCALE} == (set(base) if k == 0 else set())
    first = gen.engine.loaded[0][1]
    for name, w in base.items():  # the base as the trainer holds it, unmerged
        assert torch.equal(first[name], w), name
    assert gen.sync_side.lora.pending is None and gen.sync_side.held_base != -1


@torch.no_grad()
def _adapters(version: int, seed: int, rank: int = 2) -> tuple:
    """An ADAPTERS payload for every wq and w1 of the engine test model, and its merges."""
    base = tiny_qwen3().state_dict()
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, w in base.items():
        if name.endswith(("attention.wq.weight", "feed_forward.w1.weight")):
            prefix = name.removesuffix(".weight")
            state[f"{prefix}.lora_A"] = 0.3 * torch.randn(rank, w.shape[1], generator=g)
            state[f"{prefix}.lora_B"] = 0.3 * torch.randn(w.shape[0], rank, generator=g)
    packed = pack_weights(adapter_payload(state, 2.0), version)
    merged = dict(base)
    for name in [k.removesuffix(".lora_A") for k in state if k.endswith(".lora_A")]:
        a, b = state[f"{name}.lora_A"], state[f"{name}.lora_B"]
        merged[f"{name}.weight"] = base[f"{name}.weight"] + 2.0 * (b @ a)
    return packed, merged


@pytest.mark.parametrize("recompute", [False, True], ids=["keep_kv", "recompute"])
def test_request_admitted_after_an_adapter_version_never_reuses_older_kv(recompute):
    """As the full-weights test of test_engine_paged: a request runs across the pull of an
    adapter-only version (a partial load), and one sharing its first 12 tokens arrives
    once it ended. It is served under the new version, with a clean run's tokens, and reuses
    no KV written under the previous adapters (unless recompute rewrote them)."""
    v1, _ = _adapters(1, seed=1)
    v2, merged_v2 = _adapters(2, seed=2)
    running_prompt = prompt(13)
    later_prompt = np.concatenate([running_prompt, prompt(3, 50)]).astype(np.int32)
    sampling = replace(GREEDY, max_tokens=20)

    async def main():
        engine = make_engine(block_size=4, steps_per_yield=1, recompute_on_sync=recompute)
        lora = LoRABase(pack_weights(tiny_qwen3().state_dict(), 0), base_id=9, device="cpu")
        state, partial = lora.merge(v1, torch.float32)
        assert not partial  # the first merge brings the base's other weights along
        engine.load_weights(state, 1, partial=partial)
        running = asyncio.create_task(
            engine.generate(running_prompt, request_id="running", sampling=sampling)
        )
        await yield_loop(6)
        state, partial = lora.merge(v2, torch.float32)
        assert partial and len(state) == 4  # 2 layers x (wq, w1)
        engine.load_weights(state, 2, partial=partial)
        await running
        later = await engine.generate(later_prompt, request_id="later", sampling=sampling)
        across = await running
        await engine.close()
        return across, later

    across, later = run(main())
    assert (across.policy_version_min, across.policy_version_max) == (1, 2)
    clean = clean_run_on(merged_v2, 2, later_prompt, sampling)
    assert later.metrics["generator/prefix_hit_tokens"] == (12 if recompute else 0)
    assert later.policy_version_min == later.policy_version_max == 2
    np.testing.assert_array_equal(later.token_ids_N, clean.token_ids_N)
    np.testing.assert_allclose(later.logprobs_N, clean.logprobs_N, atol=1e-6, rtol=0)


def test_merges_are_made_one_at_a_time_as_the_engine_copies_them(monkeypatch):
    """The engine gets a lazy state: each merged weight is made when the engine reads it,
    and the one before is gone by then (one weight's temporaries on the device at a time),
    with the values of merging all at once; the first state brings the base's other weights
    along, later ones only the merges."""
    from torchtitan_rl.weight_sync.lora_sync import MergedWeights

    v1, merged_v1 = _adapters(1, seed=1)
    v2, merged_v2 = _adapters(2, seed=2)
    made, alive_when_next_made = [], []
    make = MergedWeights.__getitem__

    def recording(self, name):
        alive_when_next_made.append(sum(ref() is not None for ref in made))
        out = make(self, name)
        if name in self._adapters:
            made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(MergedWeights, "__getitem__", recording)
    engine = make_engine()
    lora = LoRABase(pack_weights(tiny_qwen3().state_dict(), 0), base_id=9, device="cpu")
    for packed, merged, partial in ((v1, merged_v1, False), (v2, merged_v2, True)):
        made.clear()
        alive_when_next_made.clear()
        state, got_partial = lora.merge(packed, torch.float32)
        assert isinstance(state, MergedWeights) and got_partial == partial
        assert len(state) == (len(merged) if not partial else 4)  # 2 layers x (wq, w1)
        engine.load_weights(state, packed.version, partial=partial)
        assert len(made) == 4 and set(alive_when_next_made) == {0}
        params = dict(engine.model_parameters())
        for name, want in merged.items():
            assert torch.equal(params[name], want), name


@pytest.mark.parametrize("transport", ["controller", "delta"])
def test_a_base_sync_drops_its_buffers_on_both_sides_before_freeing_memory(monkeypatch, transport):
    """The trainer's BASE sender (its buffer as large as the model) is dropped as the sync
    closes, not kept for a hand-over like other senders; the generator hands its received
    buffer back once the base is in host memory, its receiver with it where no group is
    left (through the controller; with CUDA IPC the trainer's buffer is then free), else at
    the next sync, which replaces the group's receiver (and the delta's copy of the base)."""
    import torchtitan_rl.weight_sync.sides as sides

    trainer, gen = _trainer(), _generator()
    buffers, receivers, released = [], [], []
    open_, join = SendingSide.open, ReceivingSide.join

    def recording_open(self, *args, **kwargs):
        offer = open_(self, *args, **kwargs)
        buffers.append((self.payload, weakref.ref(self.sender)))
        return offer

    async def recording_join(self, *args, **kwargs):
        await join(self, *args, **kwargs)
        receivers.append((self.payload, weakref.ref(self.receiver)))

    def release(device):  # what is still held when memory is handed back
        released.append([(p, ref() is not None) for p, ref in buffers + receivers])

    monkeypatch.setattr(SendingSide, "open", recording_open)
    monkeypatch.setattr(ReceivingSide, "join", recording_join)
    monkeypatch.setattr(sides, "release_cached_memory", release)

    async def run_syncs():
        sync = await WeightSync.create(_Mesh(trainer), [_Mesh(gen)], "float32", transport)
        await sync()
        await sync.close()  # an adapter sync's sender is kept for a hand-over

    asyncio.run(run_syncs())
    base, adapters = Payload.BASE, Payload.ADAPTERS
    if transport == "controller":  # the generator's release, then the trainer's
        assert released == [[(base, True), (base, False)], [(base, False), (base, False)]]
    else:  # and the generator's again as the adapter sync replaces its receiver
        assert released == [
            [(base, True), (base, True)], [(base, False), (base, True)],
            [(base, False), (adapters, True), (base, False)],
        ]  # fmt: skip
    assert [(p, ref() is not None) for p, ref in buffers + receivers] == [
        (base, False), (adapters, True), (base, False), (adapters, True),
    ]  # fmt: skip
    assert trainer.sync_side.closed is not None and gen.sync_side.held_base != -1


@pytest.mark.gpu
def test_on_a_gpu_the_base_waits_in_locked_host_memory_and_merges_bit_for_bit():
    """A generator on a GPU keeps none of the base there: the base is in page-locked host
    memory, and each merge (its base copied over as it is made) has the bits of the same
    merge with the base on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    base = {k: v.to(device, torch.bfloat16) for k, v in tiny_qwen3().state_dict().items()}
    v1, _ = _adapters(1, seed=1)
    v1.flat_P = v1.flat_P.to(device)
    packed = pack_weights(base, 0, torch.bfloat16)
    packed.flat_P = packed.flat_P.to(device)
    before = torch.cuda.memory_allocated(device)
    lora = LoRABase(packed, base_id=9, device=device, placement="host")
    del packed
    assert lora.host.locked and lora.host.flat_P.device.type == "cpu"
    assert torch.cuda.memory_allocated(device) <= before - lora.nbytes()  # the packed base went
    state, _ = lora.merge(v1, torch.bfloat16)
    tensors = unpack_weights(v1)
    for name in [k.removesuffix(".lora_A") for k in tensors if k.endswith(".lora_A")]:
        a, b, w = tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"], base[f"{name}.weight"]
        want = (w.float() + 2.0 * (b.float() @ a.float())).to(torch.bfloat16)
        assert torch.equal(state[f"{name}.weight"], want), name


@pytest.mark.gpu
def test_a_lora_generator_sharing_the_trainer_gpu_holds_the_merged_weights_bit_for_bit(tmp_path):
    """The whole path on one GPU (trainer and generator processes, CUDA IPC): the base
    once, then adapters merged from host memory; after the start and a 2-step warm start
    the generator holds what a merged sync packs on the trainer's GPU, bit for bit."""
    from pathlib import Path

    from torchtitan_rl.config import load_config
    from torchtitan_rl.controller.loop import Controller

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = load_config(
        Path(__file__).resolve().parents[1] / "train_configs" / "alphabet_sort_tiny.toml",
        [f"--job.output_dir={tmp_path}", "--parallelism.device=cuda",
         "--parallelism.trainer_procs=1", "--warm_start.steps=2", "--warm_start.batch_size=4",
         "--training.dtype=bfloat16", "--generator.dtype=bfloat16", "--lora.rank=4",
         "--generator.max_num_seqs=4", "--generator.cuda_graphs=false"],
    )  # fmt: skip

    async def scenario():
        controller = Controller(config, use_tqdm=False)
        try:
            await controller.start()
            await controller.warm_start()
            sync = controller.fleet.weight_sync
            published = await controller.trainer.publish_weights.call("bfloat16")
            packed = [p for p in published.values() if p is not None][0]
            got = await controller.fleet.actors[0].weights.call_one()
            return sync.transport, sync.payload, unpack_weights(packed), got
        finally:
            await controller.close()

    transport, payload, want, got = asyncio.run(scenario())
    assert (transport, payload) == ("cuda_ipc", Payload.ADAPTERS)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
