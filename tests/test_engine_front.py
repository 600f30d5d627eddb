"""The engine's threaded driver (generation/front.py): requests join the next engine step,
completions match the inline driver's, and close, cancellation and failures reach the
callers; the step in flight is kept across new arrivals and finished requests."""

import asyncio
import threading
from dataclasses import replace

import numpy as np
import pytest
from fakes import tiny_qwen3
from test_engine_look_ahead import assert_identical, prompt, samplings

from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig


def engine(*, threaded: bool, look_ahead: bool = False) -> Engine:
    config = EngineConfig(max_num_seqs=6, max_seq_len=40)
    return Engine(tiny_qwen3(), config, look_ahead=look_ahead, threaded=threaded, steps_per_yield=2)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def staggered(e: Engine, prompts, params, gap_s: float = 0.0):
    """Requests sent one after another (a pause between them), all awaited."""
    tasks = []
    for i, (p, s) in enumerate(zip(prompts, params)):
        tasks.append(asyncio.ensure_future(e.generate(p, request_id=str(i), sampling=s)))
        await asyncio.sleep(gap_s)
    outs = await asyncio.gather(*tasks)
    await e.close()
    return outs


def test_threaded_driver_gives_the_inline_drivers_completions():
    prompts = [prompt(3 + i, offset=i) for i in range(8)]
    params = samplings(8)
    got = run(staggered(engine(threaded=True), prompts, params, gap_s=0.005))
    ref = run(staggered(engine(threaded=False), prompts, params))
    assert_identical(got, ref)


def test_a_request_joins_the_next_step_while_others_run():
    """The engine thread runs steps back to back; a request sent meanwhile is sampled in
    the step after the one running when it arrived (2 with a step queued ahead)."""
    long = replace(samplings(1, stop_token_ids=())[0], max_tokens=30)

    async def main(look_ahead: bool):
        e = engine(threaded=True, look_ahead=look_ahead)
        first = asyncio.ensure_future(e.generate(prompt(4), request_id="a", sampling=long))
        while e.stats["steps"] < 5:
            await asyncio.sleep(0.001)
        late = await e.generate(prompt(6, 1), request_id="b", sampling=samplings(1)[0])
        await first
        await e.close()
        return late, e.stats

    for look_ahead, bound in [(False, 1), (True, 2)]:
        late, stats = run(main(look_ahead))
        assert 1 <= late.metrics["generator/steps_to_first_token"] <= bound
        assert stats["steps"] >= 10


def test_close_fails_outstanding_requests_and_stops_the_thread():
    async def main():
        e = engine(threaded=True)
        params = replace(samplings(1, stop_token_ids=())[0], max_tokens=35)
        tasks = [
            asyncio.ensure_future(e.generate(prompt(4, i), request_id=str(i), sampling=params))
            for i in range(3)
        ]
        while e.stats["steps"] < 2:
            await asyncio.sleep(0.001)
        await e.close()
        return await asyncio.gather(*tasks, return_exceptions=True), e

    outs, e = run(main())
    assert all(isinstance(o, RuntimeError) and "engine closed" in str(o) for o in outs)
    assert not any(t.name == "engine" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="engine closed"):
        run(e.generate(prompt(3), request_id="x"))


def test_a_failing_step_fails_every_caller_with_its_reason():
    async def main():
        e = engine(threaded=True)

        def broken(*args, **kwargs):
            raise RuntimeError("device lost")

        e.runner.forward = broken
        outs = await asyncio.gather(
            *(e.generate(prompt(4, i), request_id=str(i)) for i in range(2)),
            return_exceptions=True,
        )
        with pytest.raises(RuntimeError, match="engine loop stopped"):
            await e.generate(prompt(3), request_id="later")
        await e.close()
        return outs

    outs = run(main())
    assert all("engine loop failed" in str(o) and "device lost" in str(o) for o in outs)


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
def test_look_ahead_stays_in_flight_across_arrivals_and_finishes(threaded):
    """With look-ahead every step but the first is queued before the previous one's tokens
    are read, though requests finish at different steps and others arrive meanwhile; the
    completions are those of stepping one at a time."""
    prompts = [prompt(3 + i, offset=i) for i in range(9)]
    params = samplings(5, stop_token_ids=()) + samplings(4)  # the first five run on

    async def main(e: Engine):
        first = [
            asyncio.ensure_future(e.generate(p, request_id=str(i), sampling=s))
            for i, (p, s) in enumerate(zip(prompts[:5], params[:5]))
        ]
        while e.stats["steps"] < 3:
            await asyncio.sleep(0.001)
        rest = [
            asyncio.ensure_future(e.generate(p, request_id=str(5 + i), sampling=s))
            for i, (p, s) in enumerate(zip(prompts[5:], params[5:]))
        ]
        outs = await asyncio.gather(*first, *rest)
        await e.close()
        return outs, dict(e.stats)

    got, stats = run(main(engine(threaded=threaded, look_ahead=True)))
    ref, _ = run(main(engine(threaded=False, look_ahead=False)))
    assert_identical(got, ref)
    assert stats["prefill_rows_joined"] >= 1
    # the first step has nothing in flight before it; every later step was queued ahead
    assert stats["drained_steps"] == 1
    assert len({len(c.token_ids_N) for c in got}) > 1  # requests finished at different steps
    np.testing.assert_array_equal(
        [c.metrics["generator/preemptions"] for c in got], np.zeros(len(got))
    )


def test_a_request_sent_as_the_thread_fails_is_failed_not_lost(monkeypatch):
    """`generate` checks for a failed thread, then queues: the thread failing in between
    (forced here) must not leave the request in an inbox no one reads."""

    async def main():
        e = engine(threaded=True)
        steps, fail = e._steps, threading.Event()

        def failing(num_steps):
            if fail.is_set():
                raise RuntimeError("device lost")
            return steps(num_steps)

        ensure = e._ensure_driver

        def ensure_then_fail():
            ensure()
            if e._inbox or e._has_running():  # the second request: fail the thread now
                fail.set()
                e._wake.set()
                e._thread.join()

        monkeypatch.setattr(e, "_steps", failing)
        monkeypatch.setattr(e, "_ensure_driver", ensure_then_fail)
        params = replace(samplings(1)[0], max_tokens=30, stop_token_ids=())
        first = asyncio.ensure_future(e.generate(prompt(4), request_id="0", sampling=params))
        while not e._has_running():
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(e.generate(prompt(5), request_id="1", sampling=params))
        outs = await asyncio.wait_for(
            asyncio.gather(first, second, return_exceptions=True), timeout=10
        )
        await e.close()
        return outs

    first, second = run(main())
    assert "device lost" in str(first)
    assert isinstance(second, RuntimeError) and "engine loop stopped" in str(second)


def test_the_driver_counts_its_busy_and_weight_pull_seconds():
    """`loop_seconds` (reported per step through the generator's `engine_stats`): busy
    grows with passes, pull only when weights were pulled, and stays within busy."""

    async def main():
        e = engine(threaded=True)
        await e.generate(prompt(4), request_id="a", sampling=samplings(1)[0])
        before = dict(e.loop_seconds)
        state = {k: v.detach().clone() for k, v in e.model_parameters()}
        e.load_weights(state, version=1)
        await e.generate(prompt(5, 1), request_id="b", sampling=samplings(1)[0])
        await e.close()
        return before, dict(e.loop_seconds), e.runner.eager

    before, after, eager = run(main())
    assert before["busy_s"] > 0 and before["pull_s"] == 0
    assert after["pull_s"] > 0 and after["busy_s"] >= before["busy_s"] + after["pull_s"]
    assert eager == {"eager_prefills": 0, "eager_prefill_tokens": 0}  # CPU: packed steps
