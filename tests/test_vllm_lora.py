"""lora.vllm_sync = "adapters" with the real vLLM (CPU build in CI): vLLM serves each [lora]
version as a LoRA adapter of its own over the base, and gives what the merged path (the same
vLLM reloading W + scale * B @ A) gives; no request reads keys/values of another version's
adapter; running requests across a pull carry the versions they were really sampled under.

fp32 everywhere. The served path computes x W^T + scale * (x A^T) B^T where the merged path
computes x (W + scale * B A)^T: the same sums in another order, so the log-probs agree to
fp32 rounding (~1e-6 seen), not bit for bit. Asserted at 1e-4, the tolerance of the other vLLM
tests (test_vllm_backend.py), 100x what is seen; greedy tokens are identical.
"""

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from fakes import TRAINER_VOCAB  # noqa: E402
from test_lora import _one_row  # noqa: E402
from test_lora_sync import _adapter_bytes, _step, _trainer  # noqa: E402
from test_weight_sync_members import _Mesh  # noqa: E402

from torchtitan_rl.actors.generator import GeneratorActor, build_engine  # noqa: E402
from torchtitan_rl.generation.interface import AdapterUse, EngineConfig  # noqa: E402
from torchtitan_rl.generation.vllm_lora import MAX_LIVE_ADAPTERS  # noqa: E402
from torchtitan_rl.models.hf_export import export_hf  # noqa: E402
from torchtitan_rl.models.lora import TARGETS, LoRAConfig  # noqa: E402
from torchtitan_rl.models.qwen3 import ModelConfig, build_model  # noqa: E402
from torchtitan_rl.models.tokenizer import Tokenizer  # noqa: E402
from torchtitan_rl.types import SamplingParams  # noqa: E402
from torchtitan_rl.weight_sync.lora_sync import SCALE, Payload  # noqa: E402
from torchtitan_rl.weight_sync.sides import ReceivingSide  # noqa: E402
from torchtitan_rl.weight_sync.transport import WeightSync  # noqa: E402

pytestmark = pytest.mark.vllm
VOCAB = Tokenizer.from_file(None).vocab_size
TOL = 1e-4
RANK, ALPHA = 4, 8.0  # scale 2
PROMPT = np.arange(1, 41, dtype=np.int32)  # 40 tokens: one full 32-token block to share
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """vLLM serving adapters (lora.vllm_sync = "adapters") and vLLM taking merged weights
    ("merged"), started from the same base, in one event loop; and the base's weights."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(), VOCAB, torch.device("cpu"))
    base = {k: v.clone() for k, v in model.state_dict().items()}
    folder = str(export_hf(base, model.model_args, tmp_path_factory.mktemp("hf") / "m"))
    loop = asyncio.new_event_loop()
    config = EngineConfig(backend="vllm", block_size=32, max_num_seqs=16, max_seq_len=256)
    built = {}
    for sync in ("adapters", "merged"):
        lora = LoRAConfig(rank=RANK, alpha=ALPHA, vllm_sync=sync)
        built[sync] = build_engine(ModelConfig(), config, VOCAB, torch.device("cpu"), folder, lora)
    assert built["adapters"].adapter_use is AdapterUse.SERVE
    assert built["merged"].adapter_use is AdapterUse.FULL
    yield loop, built["adapters"], built["merged"], base
    for engine in built.values():
        loop.run_until_complete(engine.close())
    loop.close()


def _run(loop, coro):
    return loop.run_until_complete(coro)


@torch.no_grad()
def _adapters(base: dict, seed: int) -> dict[str, torch.Tensor]:
    """One version's adapters on every projection of every layer (torchtitan names), with
    B far from zero, and the scale, as an ADAPTERS payload unpacks."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in base.items():
        if any(name.endswith(f"{tt}.weight") for tt, _ in TARGETS.values()):
            prefix = name.removesuffix(".weight")
            out[f"{prefix}.lora_A"] = 0.2 * torch.randn(RANK, w.shape[1], generator=g)
            out[f"{prefix}.lora_B"] = 0.2 * torch.randn(w.shape[0], RANK, generator=g)
    out[SCALE] = torch.tensor(ALPHA / RANK)
    return out


def _merged(base: dict, adapters: dict) -> dict[str, torch.Tensor]:
    scale = float(adapters[SCALE])
    out = dict(base)
    for name in [k.removesuffix(".lora_A") for k in adapters if k.endswith(".lora_A")]:
        a, b = adapters[f"{name}.lora_A"], adapters[f"{name}.lora_B"]
        out[f"{name}.weight"] = base[f"{name}.weight"] + scale * (b @ a)
    return out


def _pull(served, merged, base: dict, version: int, seed: int, *, first: bool = False):
    """Version `version` to both engines: its adapters (with the base's weights the first
    time, as weight_sync's ServedBase sends them) to `served`, the merges to `merged`."""
    adapters = _adapters(base, seed)
    state = {**base, **adapters} if first else adapters
    served.load_weights(state, version, partial=not first)
    merged.load_weights(_merged(base, adapters), version)


def _both(loop, served, merged, prompt, request_id, sampling):
    return [
        _run(loop, e.generate(prompt, request_id=request_id, sampling=sampling))
        for e in (served, merged)
    ]


def _same(ours, theirs):
    np.testing.assert_array_equal(ours.token_ids_N, theirs.token_ids_N)
    np.testing.assert_allclose(ours.logprobs_N, theirs.logprobs_N, atol=TOL, rtol=0)


def test_served_adapters_give_the_merged_paths_tokens_and_logprobs(engines):
    """The base with version 1's adapters: greedy and sampled (temperature 0.7, top-p 0.8,
    top-k 50, same seed) completions of the served path equal the merged path's, kept
    supports too; vLLM's weights stay the base (nothing merged into them)."""
    loop, served, merged, base = engines
    _pull(served, merged, base, 1, seed=1, first=True)
    ours, theirs = _both(loop, served, merged, PROMPT, "g", SamplingParams(temperature=0.0,
                         max_tokens=12))  # fmt: skip
    _same(ours, theirs)
    sampling = SamplingParams(temperature=0.7, top_p=0.8, top_k=50, max_tokens=12, seed=5)
    sampling.return_support = True
    ours, theirs = _both(loop, served, merged, PROMPT, "s", sampling)
    _same(ours, theirs)
    np.testing.assert_array_equal(ours.support_ids, theirs.support_ids)
    np.testing.assert_array_equal(ours.support_offsets, theirs.support_offsets)
    assert (ours.policy_version_min, ours.policy_version_max) == (1, 1)
    # served from a PEFT folder of version 1's adapters alone
    adapter = served._adapters.current
    assert adapter.version == 1 and adapter.request.lora_name == f"policy-v1-{adapter.id}"
    folder = Path(adapter.request.lora_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert sorted(config["target_modules"]) == sorted(TARGETS)
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors",
    ]  # fmt: skip


def test_a_request_after_an_adapter_pull_never_reads_the_old_adapters_kv(engines):
    """A prompt cached under version v (a second request hits its full block), then version
    v + 1's adapters: the same prompt now hits nothing, is labelled v + 1 and gives the
    merged path's tokens on v + 1; a second request under v + 1 hits again (the cache is on,
    keyed by adapter). A name or id reused across versions would serve the old adapter or
    its keys/values (the peers' bugs): the tokens would then be version v's."""
    loop, served, merged, base = engines
    _pull(served, merged, base, 10, seed=10, first=served._adapters.current is None)
    _run(loop, served.generate(PROMPT, request_id="warm", sampling=GREEDY))
    again = _run(loop, served.generate(PROMPT, request_id="warm2", sampling=GREEDY))
    assert again.metrics["generator/prefix_hit_tokens"] >= 32
    _pull(served, merged, base, 11, seed=11)
    after, reference = _both(loop, served, merged, PROMPT, "after", GREEDY)
    assert after.metrics["generator/prefix_hit_tokens"] == 0
    assert (after.policy_version_min, after.policy_version_max) == (11, 11)
    _same(after, reference)
    assert np.abs(after.logprobs_N - again.logprobs_N).max() > 1e-3, "the adapters changed"
    later = _run(loop, served.generate(PROMPT, request_id="later", sampling=GREEDY))
    assert later.metrics["generator/prefix_hit_tokens"] >= 32
    _same(later, reference)
    assert set(served._adapters.live) == {served._adapters.current.id}  # v10's was removed
    assert served._llm.list_loras() == {served._adapters.current.id}


async def _admitted(engine, n: int) -> None:
    """Until `n` requests run in vLLM and each has sampled a token."""
    while len(engine._running) < n or any(r.last is None for r in engine._running.values()):
        await asyncio.sleep(0)


def test_a_request_running_across_a_pull_finishes_under_its_own_adapter(engines):
    """Hot swap without recompute_on_sync: a request admitted under version v keeps v's
    adapter to its end (its tokens all carry v, and equal the merged path's on v), while a
    request arriving after the pull of v + 1 is served at once (no wait for the running one:
    it finishes first) under v + 1, reusing no block of v. v's adapter goes once unused."""
    loop, served, merged, base = engines
    _pull(served, merged, base, 20, seed=20, first=served._adapters.current is None)
    long_sampling = SamplingParams(temperature=0.0, max_tokens=150)
    reference_v20 = _run(loop, merged.generate(PROMPT, request_id="ref", sampling=long_sampling))

    async def run():
        long = asyncio.ensure_future(
            served.generate(PROMPT, request_id="long", sampling=long_sampling)
        )
        await _admitted(served, 1)
        _pull(served, merged, base, 21, seed=21)
        late = await served.generate(PROMPT, request_id="late", sampling=GREEDY)
        assert not long.done(), "the late request did not wait for the running one"
        assert len(served._adapters.live) == 2  # v20 still runs
        return await long, late

    long, late = _run(loop, run())
    assert (long.policy_version_min, long.policy_version_max) == (20, 20)
    _same(long, reference_v20)
    assert (late.policy_version_min, late.policy_version_max) == (21, 21)
    assert late.metrics["generator/prefix_hit_tokens"] == 0
    _same(late, _run(loop, merged.generate(PROMPT, request_id="late", sampling=GREEDY)))
    assert set(served._adapters.live) == {served._adapters.current.id}


def test_recompute_on_sync_moves_running_requests_onto_the_new_adapter(engines):
    """recompute_on_sync: a greedy request running across the pull of v + 1 carries both
    versions; its first k tokens are v's greedy tokens and the rest the greedy continuation
    of prompt + those k under v + 1 (re-prefilled under v + 1's adapter: no block of v read),
    log-probs included; v's adapter is removed at the pull."""
    loop, served, merged, base = engines
    served.config = dataclasses.replace(served.config, recompute_on_sync=True)
    try:
        _pull(served, merged, base, 30, seed=30, first=served._adapters.current is None)
        sampling = SamplingParams(temperature=0.0, max_tokens=120)
        ref_v30 = _run(loop, merged.generate(PROMPT, request_id="r30", sampling=sampling))

        async def run():
            long = asyncio.ensure_future(
                served.generate(PROMPT, request_id="moved", sampling=sampling)
            )
            await _admitted(served, 1)
            _pull(served, merged, base, 31, seed=31)
            while served.policy_version != 31:
                await asyncio.sleep(0)
            (request,) = served._running.values()
            assert set(served._adapters.live) == {served._adapters.current.id}
            return request.done_ids[:], await long

        done, moved = _run(loop, run())
    finally:
        served.config = dataclasses.replace(served.config, recompute_on_sync=False)
    k = len(done)
    assert 0 < k < 120 and (moved.policy_version_min, moved.policy_version_max) == (30, 31)
    np.testing.assert_array_equal(moved.token_ids_N[:k], ref_v30.token_ids_N[:k])
    np.testing.assert_allclose(moved.logprobs_N[:k], ref_v30.logprobs_N[:k], atol=TOL, rtol=0)
    rest = SamplingParams(temperature=0.0, max_tokens=120 - k)
    context = np.concatenate([PROMPT, done]).astype(np.int32)
    ref_v31 = _run(loop, merged.generate(context, request_id="r31", sampling=rest))
    np.testing.assert_array_equal(moved.token_ids_N[k:], ref_v31.token_ids_N)
    np.testing.assert_allclose(moved.logprobs_N[k:], ref_v31.logprobs_N, atol=TOL, rtol=0)


def test_at_most_max_live_adapters_stay_loaded(engines):
    """One request admitted under each of versions v, v + 1, v + 2, then v + 3: vLLM holds at
    most MAX_LIVE_ADAPTERS adapters, so the oldest request moves onto v + 3 (both versions
    on it), the others finish under their own; at the end only the current one is left."""
    loop, served, merged, base = engines
    assert MAX_LIVE_ADAPTERS == 3
    _pull(served, merged, base, 40, seed=40, first=served._adapters.current is None)
    sampling = SamplingParams(temperature=0.0, max_tokens=200)

    async def run():
        calls = []
        for i, version in enumerate((41, 42, 43)):
            calls.append(asyncio.ensure_future(
                served.generate(PROMPT, request_id=f"r{i}", sampling=sampling)
            ))  # fmt: skip
            await _admitted(served, i + 1)
            _pull(served, merged, base, version, seed=version)
            while served.policy_version != version:
                await asyncio.sleep(0)
            assert len(served._llm.list_loras()) <= MAX_LIVE_ADAPTERS
        assert all(not c.done() for c in calls), "each request ran across the pulls"
        return await asyncio.gather(*calls)

    first, second, third = _run(loop, run())
    assert (first.policy_version_min, first.policy_version_max) == (40, 43)
    assert (second.policy_version_min, second.policy_version_max) == (41, 41)
    assert (third.policy_version_min, third.policy_version_max) == (42, 42)
    assert set(served._adapters.live) == {served._adapters.current.id}
    assert served._llm.list_loras() == {served._adapters.current.id}


def test_a_request_running_across_a_new_base_moves_onto_the_new_adapter(engines):
    """A new base (after a warm start that trained it) with version v + 1's adapters while
    a request of version v runs, without recompute_on_sync: v's adapter belongs to the old
    base, so finishing under it would sample from a policy that never existed (the new base
    with v's adapter) under v's label. The request moves onto v + 1 as recompute_on_sync
    moves it: its first k tokens are v's, the rest the merged path's continuation on the
    new base with v + 1's adapters, and it carries both versions."""
    loop, served, merged, base = engines
    _pull(served, merged, base, 50, seed=50, first=served._adapters.current is None)
    sampling = SamplingParams(temperature=0.0, max_tokens=120)
    ref_v50 = _run(loop, merged.generate(PROMPT, request_id="r50", sampling=sampling))
    new_base = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(51))
                for k, v in base.items()}  # fmt: skip

    async def run():
        long = asyncio.ensure_future(served.generate(PROMPT, request_id="b", sampling=sampling))
        await _admitted(served, 1)
        _pull(served, merged, new_base, 51, seed=51, first=True)
        while served.policy_version != 51:
            await asyncio.sleep(0)
        (request,) = served._running.values()
        return request.done_ids[:], await long

    try:
        done, moved = _run(loop, run())
        k = len(done)
        assert 0 < k < 120 and (moved.policy_version_min, moved.policy_version_max) == (50, 51)
        np.testing.assert_array_equal(moved.token_ids_N[:k], ref_v50.token_ids_N[:k])
        context = np.concatenate([PROMPT, done]).astype(np.int32)
        rest = SamplingParams(temperature=0.0, max_tokens=120 - k)
        ref_v51 = _run(loop, merged.generate(context, request_id="r51", sampling=rest))
        np.testing.assert_array_equal(moved.token_ids_N[k:], ref_v51.token_ids_N)
        np.testing.assert_allclose(moved.logprobs_N[k:], ref_v51.logprobs_N, atol=TOL, rtol=0)
        assert set(served._adapters.live) == {served._adapters.current.id}
    finally:  # the other tests' base
        _pull(served, merged, base, 52, seed=52, first=True)


@pytest.mark.parametrize("vllm_sync", ["adapters", "merged"])
def test_vllm_sync_decides_what_each_sync_moves_and_vllm_serves_the_trainers_policy(
    vllm_sync, tmp_path
):
    """The trainer's and the generator's actor code over the controller transport, a real
    TrainerCore with [lora] (rank 3, scale 8/3) and a vLLM generator started from another
    init (every weight it computes with must come from the syncs). "adapters": the base
    once, then each sync moves the adapters' bytes alone; "merged": the merged full weights.
    Either way, after 3 syncs vLLM's log-probs are the trainer's."""
    trainer = _trainer(alpha=8.0, rank=3)
    other = build_model(ModelConfig(max_seq_len=64), TRAINER_VOCAB, torch.device("cpu"))
    folder = str(export_hf(other.state_dict(), other.model_args, tmp_path / "start"))
    gen = GeneratorActor.__new__(GeneratorActor)
    config = EngineConfig(backend="vllm", block_size=32, max_num_seqs=4, max_seq_len=64)
    lora = dataclasses.replace(trainer.core.lora, vllm_sync=vllm_sync)
    gen.engine = build_engine(ModelConfig(max_seq_len=64), config, TRAINER_VOCAB,
                              torch.device("cpu"), folder, lora)  # fmt: skip
    gen.device, gen.actor_name = torch.device("cpu"), "generator"
    gen.sync_side = ReceivingSide(gen.device, gen.engine.adapter_use)

    async def syncs_then_generate():
        sync = await WeightSync.create(_Mesh(trainer), [_Mesh(gen)], "float32", "controller")
        sizes = []
        for k in range(3):
            if k:
                _step(trainer, seed=k)
            await sync()
            sizes.append(trainer.sync_side.last_bytes)
        await sync.close()
        sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
        prompt = np.arange(1, 6, dtype=np.int32)
        out = await gen.engine.generate(prompt, request_id="r", sampling=sampling)
        await gen.engine.close()
        return sync.payload, sizes, prompt, out

    payload, sizes, prompt, out = asyncio.run(syncs_then_generate())
    if vllm_sync == "adapters":
        assert payload is Payload.ADAPTERS and sizes == [_adapter_bytes(trainer)] * 3
    else:
        full = sum(v.numel() * 4 for v in trainer.core.sync_state().values())
        assert payload is Payload.FULL and sizes == [full] * 3
    assert (out.policy_version_min, out.policy_version_max) == (2, 2)
    t = _one_row(np.concatenate([prompt, out.token_ids_N]), len(prompt))
    with torch.no_grad():
        trainer_N = trainer.core._logprobs(t, 1.0)[0]
    np.testing.assert_allclose(out.logprobs_N, trainer_N.numpy(), atol=TOL, rtol=0)


@pytest.mark.slow
def test_rl_steps_with_lora_adapters_served_by_vllm(tmp_path):
    """The tiny job with [lora] rank 4 and lora.vllm_sync = "adapters" through Monarch: the
    weight sync moves adapters, the generator follows the trainer's version, and the fp32
    log-probs vLLM serves under each version's adapter match the trainer's replayed ones
    (the importance ratio within 0.01 of 1) over the warm start's and 3 RL steps' syncs."""
    from pathlib import Path

    from torchtitan_rl.config import load_config
    from torchtitan_rl.controller.loop import Controller

    root = Path(__file__).resolve().parents[1]
    config = load_config(
        root / "train_configs" / "alphabet_sort_tiny.toml",
        [f"--job.output_dir={tmp_path}", "--job.run_name=vllm_lora",
         "--generator.backend=vllm", "--generator.block_size=32",
         "--generator.max_num_seqs=16", "--warm_start.steps=2", "--warm_start.batch_size=4",
         "--rollout.group_size=4", "--rollout.prompts_per_step=2", "--rollout.max_tokens=16",
         "--rollout.filter_zero_std_groups=false", "--validation.interval=0",
         "--lora.rank=4", "--lora.vllm_sync=adapters", "--training.lr=0.01"],
    )  # fmt: skip

    async def run():
        controller = Controller(config, use_tqdm=False)
        try:
            await controller.start()
            await controller.warm_start()
            steps = [await controller.rl_step(step) for step in (1, 2, 3)]
            version = await controller.fleet.actors[0].policy_version.call_one()
            return controller.fleet.weight_sync.payload, steps, version
        finally:
            await controller.close()

    payload, steps, version = asyncio.run(run())
    assert payload is Payload.ADAPTERS
    assert [m["trainer/policy_version"] for m in steps] == [3, 4, 5] and version == 5
    assert all(m["trainer/logprob_diff/max"] < np.log(1.01) for m in steps)
