"""The engine's random draws are keyed by (request seed, position): the draws it hands the
sampler, with positions advanced while the batch stays the same, are U(seed, token count)
of every live row at every step (look-ahead, preemption, cancellation, a pull with
recompute), and a request's tokens are the inverse CDF of its own logits at U(seed, p),
whatever ran beside it. On CUDA the pinned result buffers and their event are allocated
once."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from fakes import tiny_qwen3
from test_engine import prompt, run
from test_engine_look_ahead import samplings

from torchtitan_rl.generation import engine as engine_module
from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.generation.keyed_random import keyed_uniform, seed_keys


def make_engine(look_ahead: bool, device: str = "cpu", **overrides) -> Engine:
    config = EngineConfig(max_num_seqs=6, max_seq_len=40, **overrides)
    return Engine(tiny_qwen3(), config, device, look_ahead=look_ahead, threaded=False)


def watch_positions(e: Engine, monkeypatch) -> dict:
    """Checks at every sampling that each live row's draw is U(its seed, its token count);
    counts the steps whose rows were the last step's (positions advanced, not rebuilt)."""
    seen = {"steps": 0, "advanced": 0, "rows": None}
    sample = engine_module.sample_tokens

    def checked(logits_NV, **kwargs):
        rows = e._rows.requests
        seen["steps"] += 1
        seen["advanced"] += rows == seen["rows"]
        seen["rows"] = list(rows)
        live = [(i, r) for i, r in enumerate(rows) if not r.is_over()]
        want = keyed_uniform(
            seed_keys([r.sampling.seed for _, r in live]),
            torch.tensor([len(r.token_ids) for _, r in live]),
        )
        uniform_N = kwargs["uniform_N"]
        assert [uniform_N[i].item() for i, _ in live] == want.tolist()
        return sample(logits_NV, **kwargs)

    monkeypatch.setattr(engine_module, "sample_tokens", checked)
    return seen


async def generate(e: Engine, prompts, params, *, cancel=None, pull_after=None):
    tasks = [
        asyncio.ensure_future(e.generate(p, request_id=str(i), sampling=s))
        for i, (p, s) in enumerate(zip(prompts, params))
    ]
    if pull_after is not None:
        for _ in range(pull_after):
            await asyncio.sleep(0)
        e.load_weights(tiny_qwen3(1).state_dict(), version=1)
    if cancel is not None:
        await asyncio.wait([tasks[0]])
        tasks[cancel].cancel()
    outs = await asyncio.gather(*tasks, return_exceptions=True)
    await e.close()
    return outs


@pytest.mark.parametrize("look_ahead", [True, False], ids=["look_ahead", "one_at_a_time"])
@pytest.mark.parametrize(
    "case", ["stops_and_lengths", "tight_cache", "cancel", "pull_with_recompute"]
)
def test_every_live_row_samples_at_its_token_count(look_ahead, case, monkeypatch):
    overrides = {"tight_cache": dict(block_size=4, num_blocks=12)}.get(case, {})
    if case == "pull_with_recompute":
        overrides = dict(recompute_on_sync=True)
    e = make_engine(look_ahead, **overrides)
    seen = watch_positions(e, monkeypatch)
    prompts = [prompt(3 + 2 * i, offset=i) for i in range(8)]
    stops = () if case in ("cancel", "tight_cache") else (0, 9, 18, 27)
    params = samplings(8, stop_token_ids=stops)
    if case == "cancel":
        params[1] = replace(params[1], max_tokens=30)
    outs = run(
        generate(
            e, prompts, params,
            cancel=1 if case == "cancel" else None,
            pull_after=3 if case == "pull_with_recompute" else None,
        )
    )  # fmt: skip
    assert seen["steps"] > 10 and seen["advanced"] > seen["steps"] // 3, seen
    if case == "tight_cache":
        assert sum(c.metrics["generator/preemptions"] for c in outs) > 0
    if case == "cancel":
        assert isinstance(outs[1], asyncio.CancelledError)
    if case == "pull_with_recompute":
        assert any(c.policy_version_max == 1 for c in outs)


def test_tokens_are_the_inverse_cdf_of_their_own_logits_at_the_keyed_draw():
    """Each request's token p is the first id whose float64 cumulative probability (full
    forward of prompt + earlier tokens, temperature 0.8) exceeds U(seed, p), with requests
    sharing steps, waiting for a slot and preempted (a tight cache)."""
    model = tiny_qwen3()
    prompts = [prompt(4 + i, offset=i) for i in range(6)]
    params = [replace(s, temperature=0.8, max_tokens=12) for s in samplings(6, stop_token_ids=())]
    config = EngineConfig(max_num_seqs=4, max_seq_len=40, block_size=4, num_blocks=12)
    e = Engine(model, config, threaded=False)
    outs = run(generate(e, prompts, params))
    assert sum(c.metrics["generator/preemptions"] for c in outs) > 0
    for prompt_ids, sampling, out in zip(prompts, params, outs):
        tokens = torch.from_numpy(np.concatenate([prompt_ids, out.token_ids_N])).long()
        with torch.no_grad():
            logits_TV = model(tokens[None])[0].double()
        n, m = len(prompt_ids), len(out.token_ids_N)
        u_M = keyed_uniform(seed_keys([sampling.seed] * m), torch.arange(m))
        cdf_MV = torch.softmax(logits_TV[n - 1 : -1] / sampling.temperature, dim=-1).cumsum(-1)
        want_M = (cdf_MV <= u_M[:, None] * cdf_MV[:, -1:]).sum(-1)
        assert out.token_ids_N.tolist() == want_M.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_allocates_its_result_buffers_and_event_once(monkeypatch):
    """With look-ahead on CUDA, every step reuses the same pinned buffers and event (the
    host has read a step's tokens before the next step's copy is queued), and the tokens
    are those of stepping one at a time."""
    events = []
    event = torch.cuda.Event

    def counted(*args, **kwargs):
        events.append(event(*args, **kwargs))
        return events[-1]

    prompts = [prompt(3 + 2 * i, offset=i) for i in range(10)]
    params = samplings(10)
    ref = run(generate(make_engine(False, "cuda"), prompts, params))
    e = make_engine(True, "cuda")
    buffers = set()
    launch = e._launch_sample

    def watched(requests, logits_NV):
        sampled = launch(requests, logits_NV)
        buffers.add((sampled.token_ids_N.data_ptr(), sampled.logprobs_N.data_ptr()))
        return sampled

    monkeypatch.setattr(engine_module.torch.cuda, "Event", counted)
    monkeypatch.setattr(e, "_launch_sample", watched)
    got = run(generate(e, prompts, params))
    assert len(events) == 1 and len(buffers) == 1, (len(events), buffers)
    assert e.stats["steps"] > e.stats["drained_steps"]  # steps ran ahead
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a.token_ids_N, b.token_ids_N)


@pytest.mark.parametrize("seed", ["7", 1.5, None, True], ids=["str", "float", "none", "bool"])
def test_a_request_with_a_non_integer_seed_gets_an_error_and_the_engine_runs_on(seed):
    """The seed is checked with the request (an ERROR completion naming it), not when the
    engine first builds the rows' keys: that would fail every request in the engine."""
    e = make_engine(look_ahead=False)
    good = replace(samplings(1)[0], max_tokens=6, stop_token_ids=())
    bad = replace(good, seed=seed)
    outs = run(generate(e, [prompt(4), prompt(5, offset=1)], [good, bad]))
    assert outs[1].error is not None and "seed must be an integer" in outs[1].error
    assert outs[0].error is None and len(outs[0].token_ids_N) == 6


def test_a_numpy_integer_seed_keys_the_draws_as_the_same_python_integer():
    """Seeds are taken modulo 2**64 whatever integer type holds them (np.uint64 above
    2**63 included)."""
    seeds = [np.uint64(2**63 + 1), np.int64(-5), np.uint64(7)]
    want = seed_keys([2**63 + 1, -5, 7])
    assert torch.equal(seed_keys(seeds), want)
    e = make_engine(look_ahead=False)
    params = [replace(samplings(1)[0], seed=s, max_tokens=5, stop_token_ids=()) for s in seeds]
    outs = run(generate(e, [prompt(4)] * 3, params))
    e = make_engine(look_ahead=False)
    ints = [replace(p, seed=int(s)) for p, s in zip(params, seeds)]
    ref = run(generate(e, [prompt(4)] * 3, ints))
    for a, b in zip(outs, ref):
        assert a.error is None
        np.testing.assert_array_equal(a.token_ids_N, b.token_ids_N)


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 5e-5])
def test_a_temperature_too_small_to_divide_by_gets_an_error_and_the_engine_runs_on(temperature):
    """A temperature above 0 but so small that logits / t overflow float32 (or that float32
    holds as 0) once failed every request of the engine: it is one error completion naming
    the field, and the request beside it is served as if alone."""
    good = replace(samplings(1)[0], max_tokens=6, stop_token_ids=())
    tiny = replace(good, temperature=temperature, seed=3)
    prompts = [prompt(4), prompt(5, offset=1)]
    outs = run(generate(make_engine(look_ahead=False), prompts, [good, tiny]))
    alone = run(generate(make_engine(look_ahead=False), prompts[:1], [good]))
    assert outs[1].error is not None and "temperature must be 0 (greedy) or >= " in outs[1].error
    assert outs[0].error is None and len(outs[0].token_ids_N) == 6
    np.testing.assert_array_equal(outs[0].token_ids_N, alone[0].token_ids_N)
    np.testing.assert_array_equal(outs[0].logprobs_N, alone[0].logprobs_N)
