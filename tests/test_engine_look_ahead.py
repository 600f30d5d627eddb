"""The engine's look-ahead (step n+1 queued on step n's device tokens) changes no result.

Look-ahead is on by default on CUDA only; here it is forced on a CPU engine and every
completion is compared with the same engine stepping one step at a time (same tokens;
log-probs up to the rounding of a different batch size): stop tokens at
varied steps (rows computed past their end and dropped), length limits, a cache tight enough
to preempt, prefix sharing, cancellation and a weight pull between iterations.
"""

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from fakes import tiny_qwen3
from test_engine import prompt, run

from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.types import FinishReason, SamplingParams

STOPS = tuple(range(0, 97, 9))  # 11 of 97 ids: sampled rows stop after a few tokens


def engine(look_ahead: bool, steps_per_yield: int = 5, **overrides) -> Engine:
    """On the inline driver: both engines see requests and pulls between the same steps."""
    config = EngineConfig(max_num_seqs=6, max_seq_len=40)
    for key, value in overrides.items():
        setattr(config, key, value)
    return Engine(
        tiny_qwen3(), config, look_ahead=look_ahead, threaded=False, steps_per_yield=steps_per_yield
    )


def samplings(n: int, **changes) -> list[SamplingParams]:
    base = SamplingParams(temperature=1.0, max_tokens=16, stop_token_ids=STOPS)
    out = []
    for i in range(n):
        s = replace(base, seed=10 + i, max_tokens=8 + 3 * (i % 4), **changes)
        out.append(replace(s, temperature=0.0) if i % 5 == 4 else s)  # some greedy rows
    return out


def generate(e: Engine, prompts, params, *, cancel: int | None = None):
    """All completions; with `cancel`, that request is cancelled once request 0 is done."""

    async def main():
        tasks = [
            asyncio.ensure_future(e.generate(p, request_id=str(i), sampling=s))
            for i, (p, s) in enumerate(zip(prompts, params))
        ]
        if cancel is not None:
            await asyncio.wait([tasks[0]])
            tasks[cancel].cancel()
        outs = await asyncio.gather(*tasks, return_exceptions=True)
        await e.close()
        return outs

    return run(main())


def assert_identical(got, ref):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        if isinstance(b, BaseException):
            assert isinstance(a, type(b))
            continue
        assert a.finish_reason == b.finish_reason
        np.testing.assert_array_equal(a.token_ids_N, b.token_ids_N)
        # a look-ahead step's batch still holds finished rows: other matmul shapes
        np.testing.assert_allclose(a.logprobs_N, b.logprobs_N, atol=1e-5, rtol=0)
        assert (a.policy_version_min, a.policy_version_max) == (
            b.policy_version_min,
            b.policy_version_max,
        )


def test_stop_tokens_and_length_limits_give_identical_completions():
    prompts = [prompt(3 + 2 * i, offset=i) for i in range(10)]
    params = samplings(10)
    params[3] = replace(params[3], max_tokens=40)  # runs into max_seq_len
    got = generate(engine(True), prompts, params)
    ref = generate(engine(False), prompts, params)
    reasons = {c.finish_reason for c in ref}
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}
    assert_identical(got, ref)


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix_cache", "no_cache"])
def test_tight_cache_and_shared_prefixes_give_identical_completions(prefix_cache):
    group = prompt(9, offset=3)
    prompts = [group] * 4 + [prompt(6, offset=i) for i in range(4)]
    params = samplings(8, stop_token_ids=(5,))
    kwargs = dict(block_size=4, num_blocks=14, enable_prefix_cache=prefix_cache)
    got = generate(engine(True, **kwargs), prompts, params)
    ref = generate(engine(False, **kwargs), prompts, params)
    assert sum(c.metrics["generator/preemptions"] for c in ref) > 0
    assert_identical(got, ref)


def test_cancelled_request_mid_run_leaves_the_others_identical():
    prompts = [prompt(4, offset=i) for i in range(5)]
    params = samplings(5, stop_token_ids=())
    params[1] = replace(params[1], max_tokens=30)  # still running when request 0 is done
    got = generate(engine(True), prompts, params, cancel=1)
    ref = generate(engine(False), prompts, params, cancel=1)
    assert isinstance(ref[1], asyncio.CancelledError)
    assert_identical(got, ref)


def test_the_step_in_flight_at_a_pull_finishes_under_its_weights():
    """A pull first finishes the step in flight (queued under the old weights): with
    look-ahead and 3 steps a pass, the tokens and versions are those of stepping 4 steps
    under the old weights, then pulling."""

    async def main(look_ahead: bool, steps_per_yield: int):
        e = engine(look_ahead, steps_per_yield=steps_per_yield)
        params = samplings(4, stop_token_ids=())
        tasks = [
            asyncio.ensure_future(e.generate(prompt(5, i), request_id=str(i), sampling=s))
            for i, s in enumerate(params)
        ]
        for _ in range(2):
            await asyncio.sleep(0)
        e.load_weights(tiny_qwen3(1).state_dict(), version=1)
        outs = await asyncio.gather(*tasks)
        await e.close()
        return outs

    got, ref = run(main(True, 3)), run(main(False, 4))
    assert any(c.policy_version_min == 0 and c.policy_version_max == 1 for c in ref)
    assert_identical(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_engine_look_ahead_gives_identical_completions():
    prompts = [prompt(3 + 2 * i, offset=i) for i in range(10)]
    params = samplings(10)

    def cuda_engine(look_ahead: bool) -> Engine:
        config = EngineConfig(max_num_seqs=6, max_seq_len=40)
        return Engine(tiny_qwen3(), config, "cuda", look_ahead=look_ahead)

    got, ref = (
        generate(cuda_engine(True), prompts, params),
        generate(cuda_engine(False), prompts, params),
    )
    assert {c.finish_reason for c in ref} == {FinishReason.STOP, FinishReason.LENGTH}
    assert_identical(got, ref)


def test_a_row_cancelled_while_the_look_ahead_is_built_is_finished(monkeypatch):
    """The caller's loop may cancel a row while the engine thread builds the next step:
    forced here between the look-ahead's two reads of the rows (cancelled from inside
    `Request.is_over`). The row must be finished, not left running outside the step in
    flight (the next look-ahead then fed it as a prefill with no token: ValueError)."""
    from torchtitan_rl.generation.scheduler import Request

    e = engine(True, max_num_seqs=4)
    launches = {"n": 0, "armed": False}
    launch = e._launch_look_ahead

    def counted(requests, sampled):
        launches["n"] += 1
        launches["armed"] = launches["n"] == 3
        try:
            return launch(requests, sampled)
        finally:
            launches["armed"] = False

    is_over = Request.is_over

    def cancelled_now(request):
        if launches["armed"] and request.request_id == "1":
            request.future.cancel()
        return is_over(request)

    monkeypatch.setattr(e, "_launch_look_ahead", counted)
    monkeypatch.setattr(Request, "is_over", cancelled_now)
    params = samplings(3, stop_token_ids=(), temperature=0.0)
    outs = generate(e, [prompt(5, offset=i) for i in range(3)], params)
    assert isinstance(outs[1], asyncio.CancelledError)
    assert [c.finish_reason for c in (outs[0], outs[2])] == [FinishReason.LENGTH] * 2
    assert e._sched.blocks.num_free == e._sched.blocks.num_blocks
