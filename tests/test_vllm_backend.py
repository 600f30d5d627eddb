"""generator.backend = "vllm", with the real vLLM (CPU build in CI): the engine against the
native engine and the trainer's log-probs, then 3 RL steps through Monarch.

Marked `vllm`: they run wherever vLLM is installed (README, "vLLM backend") and skip
cleanly elsewhere. fp32 on both sides; vLLM's CPU kernels (oneDNN GEMMs, its own attention)
sum in another order than torch's, so log-probs agree to ~1e-6, not bit for bit: the
tolerances below are 1e-4 (100x the differences seen).
"""

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from driver import drive  # noqa: E402

from torchtitan_rl.actors.generator import build_engine  # noqa: E402
from torchtitan_rl.config import load_config  # noqa: E402
from torchtitan_rl.controller.loop import Controller  # noqa: E402
from torchtitan_rl.generation.engine import Engine  # noqa: E402
from torchtitan_rl.generation.interface import EngineConfig  # noqa: E402
from torchtitan_rl.models.hf_export import export_hf  # noqa: E402
from torchtitan_rl.models.qwen3 import ModelConfig, build_model  # noqa: E402
from torchtitan_rl.models.tokenizer import Tokenizer  # noqa: E402
from torchtitan_rl.types import FinishReason, SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
VOCAB = Tokenizer.from_file(None).vocab_size
TOL = 1e-4
VLLM_JOB = [
    "--generator.backend=vllm",
    "--generator.block_size=32",
    "--generator.max_num_seqs=16",
    "--warm_start.steps=2",
    "--warm_start.batch_size=4",
    "--rollout.group_size=4",
    "--rollout.prompts_per_step=2",
    "--rollout.max_tokens=16",
]
"""The tiny job on vLLM, small enough for CPU tests (the RL-step tests add their own keys)."""
PROMPT = np.arange(1, 41, dtype=np.int32)  # 40 tokens: one full 32-token block to share


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A vLLM engine and a native engine with the same fp32 weights, in one event loop. Started
    with flask's unbound proxies imported, as they are in any process that imported Monarch's
    job classes (vllm_engine._unscannable_modules_hidden: without it, vLLM's start fails)."""
    import flask.globals  # noqa: F401  (a torchmonarch dependency)

    torch.manual_seed(0)
    model = build_model(ModelConfig(), VOCAB, torch.device("cpu"))
    folder = export_hf(model.state_dict(), model.model_args, tmp_path_factory.mktemp("hf") / "m")
    loop = asyncio.new_event_loop()
    config = EngineConfig(backend="vllm", block_size=32, max_num_seqs=16, max_seq_len=256)
    vllm_engine = build_engine(ModelConfig(), config, VOCAB, torch.device("cpu"), str(folder))
    native = Engine(model, EngineConfig(max_num_seqs=16, max_seq_len=256), "cpu")
    yield loop, vllm_engine, native
    loop.run_until_complete(vllm_engine.close())
    loop.run_until_complete(native.close())
    loop.close()


def _run(loop, coro):
    return loop.run_until_complete(coro)


def test_processed_logprobs_and_support_match_the_native_sampler(engines):
    """Temperature 0.7, top-p 0.8, top-k 50: vLLM's log-prob of each sampled token is the
    native sampler's on the same prefix, and its kept support is the same set of ids."""
    loop, vllm_engine, native = engines
    sampling = SamplingParams(temperature=0.7, top_p=0.8, top_k=50, max_tokens=6, seed=3)
    sampling.return_support = True
    done = _run(loop, vllm_engine.generate(PROMPT, request_id="a", sampling=sampling))
    assert done.finish_reason == FinishReason.LENGTH and done.num_tokens == 6
    for i, token in enumerate(done.token_ids_N):
        ids = np.concatenate([PROMPT, done.token_ids_N[:i]]).astype(np.int32)
        kept = done.support_ids[done.support_offsets[i] : done.support_offsets[i + 1]]
        reference = _native_logprob(native.runner.model, ids, int(token), sampling)
        assert set(kept.tolist()) == set(reference[1].tolist())
        assert abs(done.logprobs_N[i] - reference[0]) < TOL


def _native_logprob(model, ids: np.ndarray, token: int, sampling: SamplingParams):
    """(log-prob of `token`, kept ids) under the native sampler's rules, from full logits."""
    from torchtitan_rl.generation.sampling import sampling_logprobs, support_mask

    tokens = torch.as_tensor(ids, dtype=torch.long)[None]
    n = tokens.shape[1]
    with torch.no_grad():
        hidden = model(
            tokens,
            torch.arange(n)[None],
            torch.zeros(1, n, dtype=torch.long),
            torch.tensor([n - 1]),
            None,
        )
    logits = hidden.float()
    temperature = torch.tensor([sampling.temperature])
    top_p = torch.tensor([sampling.top_p])
    top_k = torch.tensor([sampling.top_k])
    logprobs, _ = sampling_logprobs(logits, temperature_N=temperature, top_p_N=top_p, top_k_N=top_k)
    kept = support_mask(logits, temperature_N=temperature, top_p_N=top_p, top_k_N=top_k)
    return float(logprobs[0, token]), torch.nonzero(kept[0]).flatten()


def test_greedy_follows_the_native_convention(engines):
    """Greedy: the same argmax tokens, log-probs under temperature 1 and the full vocabulary."""
    loop, vllm_engine, native = engines
    sampling = SamplingParams(temperature=0.0, max_tokens=5)
    ours = _run(loop, vllm_engine.generate(PROMPT, request_id="g", sampling=sampling))
    theirs = _run(loop, native.generate(PROMPT, request_id="g", sampling=sampling))
    np.testing.assert_array_equal(ours.token_ids_N, theirs.token_ids_N)
    np.testing.assert_allclose(ours.logprobs_N, theirs.logprobs_N, atol=TOL, rtol=0)


def test_the_loop_runs_between_any_two_vllm_steps_and_vllm_keeps_no_stats(engines):
    """The inline driver yields after every vLLM step, so a finished turn's reply leaves and
    the next turn arrives within one step; vLLM keeps no stats of its own (its loggers cost
    ~9% of a step's CPU time in the loop: docs/benchmarks.md, "vLLM in the loop")."""
    loop, vllm_engine, _ = engines
    events, step = [], vllm_engine._step

    def counted():
        events.append("step")
        step()

    async def go():
        done = asyncio.Event()

        async def ticker():
            while not done.is_set():
                events.append("loop")
                await asyncio.sleep(0)

        tick = asyncio.ensure_future(ticker())
        sampling = SamplingParams(temperature=0.0, max_tokens=12)
        await vllm_engine.generate(PROMPT, request_id="y", sampling=sampling)
        done.set()
        await tick

    vllm_engine._step = counted
    try:
        _run(loop, go())
    finally:
        del vllm_engine._step
    assert events.count("step") >= 12
    assert ("step", "step") not in set(zip(events, events[1:]))
    assert vllm_engine._llm.log_stats is False


def test_seeds_stops_limits_and_errors(engines):
    """A request's tokens depend on its seed, not on its batch; a stop token ends it (kept
    last); max_tokens caps it; an invalid request alone comes back as an ERROR."""
    loop, vllm_engine, _ = engines
    sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=11)
    alone = _run(loop, vllm_engine.generate(PROMPT, request_id="s", sampling=sampling))

    async def crowd():
        others = [
            vllm_engine.generate(PROMPT[:20], request_id=f"o{i}", sampling=SamplingParams(seed=i))
            for i in range(5)
        ]
        return await asyncio.gather(
            vllm_engine.generate(PROMPT, request_id="s", sampling=sampling),
            vllm_engine.generate(np.array([VOCAB + 5]), request_id="bad"),
            *others,
        )

    batched, bad, *_ = _run(loop, crowd())
    np.testing.assert_array_equal(alone.token_ids_N, batched.token_ids_N)
    timings = [batched.metrics[f"generator/{k}"] for k in ("queue_time_ms",
               "time_to_first_token_ms", "decode_time_ms")]  # fmt: skip
    assert min(timings) >= 0 and timings[1] >= timings[0]  # the first token comes after admission
    assert bad.finish_reason == FinishReason.ERROR and "prompt_ids must be in" in bad.error
    stop = int(alone.token_ids_N[3])
    stopped = _run(
        loop,
        vllm_engine.generate(
            PROMPT,
            request_id="stop",
            sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=11, stop_token_ids=(stop,)),
        ),
    )
    first = int(np.flatnonzero(alone.token_ids_N == stop)[0])
    assert stopped.finish_reason == FinishReason.STOP
    np.testing.assert_array_equal(stopped.token_ids_N, alone.token_ids_N[: first + 1])


def test_weights_apply_with_a_version_and_never_reuse_older_keys(engines):
    """load_weights: later completions carry the new version, match the native engine on
    the same new weights, and do not reuse prefix blocks cached under the old weights."""
    loop, vllm_engine, native = engines
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    _run(loop, vllm_engine.generate(PROMPT, request_id="warm", sampling=sampling))
    again = _run(loop, vllm_engine.generate(PROMPT, request_id="warm2", sampling=sampling))
    assert again.metrics["generator/prefix_hit_tokens"] >= 32
    state = {k: v * 1.05 for k, v in native.runner.model.state_dict().items()}
    vllm_engine.load_weights(state, 7)
    native.load_weights(state, 7)
    after = _run(loop, vllm_engine.generate(PROMPT, request_id="after", sampling=sampling))
    reference = _run(loop, native.generate(PROMPT, request_id="after", sampling=sampling))
    assert (after.policy_version_min, after.policy_version_max) == (7, 7)
    assert vllm_engine.policy_version == 7
    assert after.metrics["generator/prefix_hit_tokens"] == 0
    np.testing.assert_array_equal(after.token_ids_N, reference.token_ids_N)
    np.testing.assert_allclose(after.logprobs_N, reference.logprobs_N, atol=TOL, rtol=0)
    assert np.abs(after.logprobs_N - again.logprobs_N).max() > 1e-3, "the weights changed"


def test_hot_swap_mid_request_keeps_versions_and_never_serves_old_keys(engines):
    """Weights pulled while a request runs: it finishes with the tokens of both versions
    (min < max); a request arriving meanwhile waits for the prefix cache reset, so it reuses
    no block computed under the old weights and gives the native engine's tokens on the new
    ones (the native engine's hot-swap test in test_engine_paged.py checks the same)."""
    loop, vllm_engine, native = engines
    before = vllm_engine.policy_version

    async def run():
        long = asyncio.ensure_future(
            vllm_engine.generate(
                PROMPT, request_id="long", sampling=SamplingParams(max_tokens=96, seed=1)
            )
        )
        while not vllm_engine._running:  # admitted and stepping
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        state = {k: v * 0.97 for k, v in native.runner.model.state_dict().items()}
        vllm_engine.load_weights(state, before + 1)
        greedy = SamplingParams(temperature=0.0, max_tokens=2)
        late = await vllm_engine.generate(PROMPT, request_id="late", sampling=greedy)
        native.load_weights(state, before + 1)
        reference = await native.generate(PROMPT, request_id="late", sampling=greedy)
        return await long, late, reference

    long, late, reference = _run(loop, run())
    assert (long.policy_version_min, long.policy_version_max) == (before, before + 1)
    assert late.policy_version_min == before + 1
    assert late.metrics["generator/prefix_hit_tokens"] == 0
    np.testing.assert_array_equal(late.token_ids_N, reference.token_ids_N)
    np.testing.assert_allclose(late.logprobs_N, reference.logprobs_N, atol=TOL, rtol=0)


@pytest.mark.slow
def test_three_rl_steps_through_monarch_with_vllm(tmp_path):
    """The default tiny job with the vllm backend, multi-turn AlphabetSort and top-p 0.8:
    the generator's version follows the trainer's; fp32 log-probs after every sync match the
    trainer's replayed ones, so the importance ratio stays within 0.01 of 1."""
    config = load_config(
        ROOT / "train_configs" / "alphabet_sort_tiny.toml",
        [
            f"--job.output_dir={tmp_path}",
            "--job.run_name=vllm",
            *VLLM_JOB,
            "--rollout.top_p=0.8",
            "--rollout.filter_zero_std_groups=false",
            "--env.max_turns=2",
            "--env.args.sort_by=random",
            "--loss.entropy_coef=0.01",
            "--validation.interval=0",
            "--training.lr=0.01",
        ],
    )

    run = drive(config, steps=3)
    steps, version = run.steps, run.generator_version
    assert [m["trainer/policy_version"] for m in steps] == [3, 4, 5]
    assert version == 5, "the generator holds the trainer's latest weights"
    assert (tmp_path / "vllm" / "generator_start_hf" / "config.json").is_file(), "vLLM started"
    assert all(m["trainer/logprob_diff/max"] < np.log(1.01) for m in steps)
    assert max(m["rollout/num_turns/mean"] for m in steps) > 1, "multi-turn rollouts"


@pytest.mark.slow
def test_rl_steps_ahead_of_training_with_vllm(tmp_path):
    """rollout.max_staleness = 1, streaming: vLLM takes new weights between its engine steps
    while batches for later steps run; every trained token stays within one version."""
    config = load_config(
        ROOT / "train_configs" / "alphabet_sort_tiny.toml",
        [
            f"--job.output_dir={tmp_path}",
            "--job.run_name=vllm_ahead",
            *VLLM_JOB,
            "--rollout.filter_zero_std_groups=false",
            "--rollout.max_staleness=1",
            "--rollout.ahead=streaming",
            "--validation.interval=0",
            "--checkpoint.interval=0",
            "--training.steps=4",
        ],
    )
    controller = Controller(config, use_tqdm=False)

    async def run():
        try:
            await controller.run()
        finally:
            await controller.close()

    asyncio.run(run())
    history = {tag: dict(series) for tag, series in controller.metrics.history.items()}
    assert sorted(history["rollout/staleness/max"]) == [1, 2, 3, 4]
    assert max(history["rollout/staleness/max"].values()) == 1.0
    assert history["trainer/policy_version"][4] == 6.0


def test_close_leaves_no_process_group(tmp_path):
    """vLLM's in-process engine core makes a torch.distributed group; close undoes it, so
    the process (a test session, an actor) can make its own afterwards."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(), VOCAB, torch.device("cpu"))
    folder = export_hf(model.state_dict(), model.model_args, tmp_path / "m")
    config = EngineConfig(backend="vllm", block_size=32, max_num_seqs=4, max_seq_len=128)

    async def run():
        engine = build_engine(ModelConfig(), config, VOCAB, torch.device("cpu"), str(folder))
        assert torch.distributed.is_initialized()
        await engine.generate(PROMPT, request_id="x", sampling=SamplingParams(max_tokens=2))
        await engine.close()

    asyncio.run(run())
    assert not torch.distributed.is_initialized()
