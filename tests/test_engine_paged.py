"""Paged cache, prefix reuse, preemption and weight-pull modes of the Engine (CPU, tiny)."""

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_engine import GREEDY, make_engine, prompt, run, tiny_qwen3, yield_loop

from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.types import SamplingParams

SAMPLED = SamplingParams(temperature=1.0, top_k=40, max_tokens=10)


def generate_all(engine, prompts, samplings):
    async def main():
        outs = await asyncio.gather(
            *(
                engine.generate(p, request_id=str(i), sampling=s)
                for i, (p, s) in enumerate(zip(prompts, samplings))
            )
        )
        await engine.close()
        return outs

    return run(main())


def assert_same(got, ref):
    np.testing.assert_array_equal(got.token_ids_N, ref.token_ids_N)
    np.testing.assert_allclose(got.logprobs_N, ref.logprobs_N, atol=1e-5, rtol=0)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_next_turn_of_a_session_reuses_cached_blocks_with_cold_run_logprobs(sampling):
    first = prompt(10)

    async def two_turns(engine):
        turn1 = await engine.generate(first, request_id="t1", session_id="s", sampling=sampling)
        second = np.concatenate([first, turn1.token_ids_N, prompt(3, 5)]).astype(np.int32)
        turn2 = await engine.generate(second, request_id="t2", session_id="s", sampling=sampling)
        await engine.close()
        return second, turn2

    second, warm = run(two_turns(make_engine(block_size=4)))
    [cold] = generate_all(
        make_engine(block_size=4, enable_prefix_cache=False), [second], [sampling]
    )
    assert warm.metrics["generator/prefix_hit_tokens"] == 4 * ((len(second) - 1) // 4) - 4
    assert cold.metrics["generator/prefix_hit_tokens"] == 0
    assert_same(warm, cold)


def test_group_siblings_share_the_prompt_blocks_in_the_same_step():
    group_prompt = prompt(13)
    samplings = [replace(SAMPLED, seed=s) for s in range(4)]
    warm = generate_all(make_engine(block_size=4), [group_prompt] * 4, samplings)
    cold = generate_all(
        make_engine(block_size=4, enable_prefix_cache=False), [group_prompt] * 4, samplings
    )
    hits = [c.metrics["generator/prefix_hit_tokens"] for c in warm]
    assert hits == [0, 12, 12, 12]
    for got, ref in zip(warm, cold):
        assert_same(got, ref)


def test_full_cache_preempts_and_recomputes_with_unchanged_results():
    prompts = [prompt(6, i) for i in range(4)]
    samplings = [
        replace(GREEDY, max_tokens=30),
        *[replace(SAMPLED, seed=i, max_tokens=30) for i in range(3)],
    ]
    # 12 blocks of 4 = 48 tokens = one full-length sequence: four 36-token requests must
    # take turns, preempting each other as they grow.
    tight = generate_all(make_engine(block_size=4, num_blocks=13), prompts, samplings)
    ample = generate_all(make_engine(block_size=4), prompts, samplings)
    assert sum(c.metrics["generator/preemptions"] for c in tight) > 0
    for got, ref in zip(tight, ample):
        assert_same(got, ref)


def reference_logprobs(model, prompt_ids, completion):
    tokens = torch.from_numpy(np.concatenate([prompt_ids, completion.token_ids_N])).long()
    with torch.no_grad():
        logprobs_TV = torch.log_softmax(model(tokens[None])[0].double(), dim=-1)
    n = len(prompt_ids)
    return logprobs_TV[n - 1 : -1].gather(1, tokens[n:, None]).squeeze(1).numpy()


@pytest.mark.parametrize("recompute", [False, True], ids=["keep_kv", "recompute"])
def test_hot_swap_changes_logprobs_from_the_next_token_and_reports_both_versions(recompute):
    old, new = tiny_qwen3(0), tiny_qwen3(1)
    sampling = replace(GREEDY, max_tokens=20)

    async def main():
        engine = make_engine(steps_per_yield=1, recompute_on_sync=recompute)
        task = asyncio.create_task(engine.generate(prompt(5), request_id="r", sampling=sampling))
        await yield_loop(6)
        engine.load_weights(new.state_dict(), version=1)
        out = await task
        await engine.close()
        return out

    out = run(main())
    assert (out.policy_version_min, out.policy_version_max) == (0, 1)
    under_old = reference_logprobs(old, prompt(5), out)
    under_new = reference_logprobs(new, prompt(5), out)
    swap = int(np.argmax(np.abs(out.logprobs_N - under_old) > 1e-4))
    assert 0 < swap < out.num_tokens - 1
    np.testing.assert_allclose(out.logprobs_N[:swap], under_old[:swap], atol=1e-5)
    # Recompute re-prefills under the new weights: exactly the new model's log-probs.
    # Without it, earlier keys/values stay from the old weights.
    after = np.abs(out.logprobs_N[swap:] - under_new[swap:]).max()
    assert after < 1e-5 if recompute else after > 1e-4


def test_drain_mode_finishes_running_requests_before_swapping_and_never_mixes():
    sampling = replace(GREEDY, max_tokens=15)

    async def main():
        engine = make_engine(steps_per_yield=1, weight_sync_mode="drain")
        early = [
            asyncio.create_task(
                engine.generate(prompt(5, i), request_id=f"e{i}", sampling=sampling)
            )
            for i in range(2)
        ]
        await yield_loop(4)
        engine.load_weights(tiny_qwen3(1).state_dict(), version=1)
        late = [
            asyncio.create_task(
                engine.generate(prompt(4, i), request_id=f"l{i}", sampling=sampling)
            )
            for i in range(2)
        ]
        outs = await asyncio.gather(*early, *late)
        await engine.close()
        return outs

    outs = run(main())
    versions = [(c.policy_version_min, c.policy_version_max) for c in outs]
    assert versions == [(0, 0), (0, 0), (1, 1), (1, 1)]


def clean_run_on(state, version, prompt_ids, sampling):
    """What an engine that loaded `state` before its first request generates."""

    async def main():
        engine = make_engine(block_size=4)
        engine.load_weights(state, version=version)
        out = await engine.generate(prompt_ids, request_id="clean", sampling=sampling)
        await engine.close()
        return out

    return run(main())


@pytest.mark.parametrize("arrives", ["after_it_ends", "at_the_pull"])
@pytest.mark.parametrize(
    "recompute, new_version",
    [(False, 1), (True, 1), (False, 0)],
    ids=["keep_kv", "recompute", "keep_kv_same_version_number"],
)
def test_request_admitted_after_a_pull_never_reuses_keys_values_of_older_weights(
    recompute, new_version, arrives
):
    """The review's scenario: a request runs across a hot-swap pull, and a request with the
    same first 12 tokens (3 blocks) arrives once it has ended, or right after the pull (it
    then runs in the forward that recomputes the first one). Without recompute the first
    request's blocks hold old-weight keys/values and must not be shared; with it they are
    rewritten under the new weights and may be. A repeated version number (the engine's
    build weights and the trainer's first weights are both version 0) changes nothing."""
    new_state = tiny_qwen3(1).state_dict()
    running_prompt = prompt(13)
    later_prompt = np.concatenate([running_prompt, prompt(3, 50)]).astype(np.int32)
    sampling = replace(GREEDY, max_tokens=20)

    async def main():
        engine = make_engine(block_size=4, steps_per_yield=1, recompute_on_sync=recompute)
        running = asyncio.create_task(
            engine.generate(running_prompt, request_id="running", sampling=sampling)
        )
        await yield_loop(6)
        engine.load_weights(new_state, version=new_version)
        if arrives == "after_it_ends":
            await running
        later = await engine.generate(later_prompt, request_id="later", sampling=sampling)
        across = await running
        await engine.close()
        return across, later

    across, later = run(main())
    assert (across.policy_version_min, across.policy_version_max) == (0, new_version)
    assert across.num_tokens == 20  # it filled blocks after the pull
    clean = clean_run_on(new_state, new_version, later_prompt, sampling)
    assert later.metrics["generator/prefix_hit_tokens"] == (12 if recompute else 0)
    assert later.policy_version_min == later.policy_version_max == new_version
    np.testing.assert_array_equal(later.token_ids_N, clean.token_ids_N)
    np.testing.assert_allclose(later.logprobs_N, clean.logprobs_N, atol=1e-6, rtol=0)


def test_request_after_a_pull_recomputes_the_prefix_of_a_finished_request():
    new_state = tiny_qwen3(1).state_dict()

    async def main():
        engine = make_engine(block_size=4)
        await engine.generate(prompt(13), request_id="a", sampling=GREEDY)
        engine.load_weights(new_state, version=1)
        out = await engine.generate(prompt(13), request_id="b", sampling=GREEDY)
        await engine.close()
        return out

    out = run(main())
    assert out.metrics["generator/prefix_hit_tokens"] == 0
    assert out.policy_version_min == out.policy_version_max == 1
    assert_same(out, clean_run_on(new_state, 1, prompt(13), GREEDY))


def test_prefix_reuse_resumes_among_requests_admitted_after_a_pull():
    """Group siblings and the next turn of a session share blocks written under the new
    weights, with a clean run's results."""
    new_state = tiny_qwen3(1).state_dict()
    group_prompt = prompt(13)
    samplings = [replace(SAMPLED, seed=s) for s in range(3)]

    async def main():
        engine = make_engine(block_size=4)
        await engine.generate(group_prompt, request_id="before", sampling=GREEDY)
        engine.load_weights(new_state, version=1)
        group = await asyncio.gather(
            *(
                engine.generate(group_prompt, request_id=f"g{i}", sampling=s)
                for i, s in enumerate(samplings)
            )
        )
        next_turn = np.concatenate([group_prompt, group[0].token_ids_N, prompt(3, 5)])
        turn2 = await engine.generate(
            next_turn.astype(np.int32), request_id="t2", session_id="s", sampling=GREEDY
        )
        await engine.close()
        return group, next_turn.astype(np.int32), turn2

    group, next_turn, turn2 = run(main())
    assert [c.metrics["generator/prefix_hit_tokens"] for c in group] == [0, 12, 12]
    assert turn2.metrics["generator/prefix_hit_tokens"] == 4 * ((len(next_turn) - 1) // 4) - 4
    for got, sampling in zip(group, samplings):
        assert_same(got, clean_run_on(new_state, 1, group_prompt, sampling))
    assert_same(turn2, clean_run_on(new_state, 1, next_turn, GREEDY))
    assert all(c.policy_version_min == c.policy_version_max == 1 for c in [*group, turn2])


def test_engine_config_rejects_bad_sync_mode_and_too_few_blocks():
    with pytest.raises(ValueError, match="weight_sync_mode"):
        EngineConfig(weight_sync_mode="sometimes").validate()
    with pytest.raises(ValueError, match="num_blocks"):
        EngineConfig(max_seq_len=64, block_size=16, num_blocks=3).validate()
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=-1).validate()


def queued(name: str, n: int):
    """A scheduler request for an n-token prompt (no engine around it)."""
    from torchtitan_rl.generation.scheduler import Request

    future = asyncio.new_event_loop().create_future()
    return Request(
        request_id=name, prompt_ids=list(range(n)), sampling=GREEDY, future=future,
        arrival_s=0.0,
    )  # fmt: skip


def test_admission_under_a_token_budget_takes_arrivals_in_order_and_at_least_one():
    from torchtitan_rl.generation.block_manager import BlockManager
    from torchtitan_rl.generation.scheduler import Scheduler

    sched = Scheduler(BlockManager(64, 4, enable_prefix_cache=False), max_num_seqs=8)
    sched.waiting.extend([queued("a", 30), queued("b", 10), queued("c", 5), queued("d", 1)])
    assert [r.request_id for r in sched.admit(0.0, max_new_tokens=12)] == ["a"]  # over, first
    assert [r.request_id for r in sched.admit(0.0, max_new_tokens=15)] == ["b", "c"]
    assert [r.request_id for r in sched.admit(0.0)] == ["d"]  # no budget: all that fits


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
def test_drain_waits_for_a_request_preempted_back_to_the_queue(threaded):
    """Two requests, a cache for one: the second is preempted (its old-weights tokens back in
    the queue) while weights are pending. Drain lets it finish before pulling."""

    async def main():
        config = EngineConfig(max_num_seqs=4, max_seq_len=32, block_size=4, num_blocks=8,
                              weight_sync_mode="drain")  # fmt: skip
        e = Engine(tiny_qwen3(), config, threaded=threaded, steps_per_yield=1)
        s = SamplingParams(temperature=0.0, max_tokens=14)
        tasks = [
            asyncio.ensure_future(e.generate(np.arange(12) + 10 * i, request_id=str(i), sampling=s))
            for i in range(2)
        ]
        while e.stats["steps"] < 1:
            await asyncio.sleep(0.001 if threaded else 0)
        e.load_weights(tiny_qwen3(1).state_dict(), version=1)
        outs = await asyncio.gather(*tasks)
        await e.close()
        return outs

    outs = run(main())
    assert sum(o.metrics["generator/preemptions"] for o in outs) > 0
    assert [(o.policy_version_min, o.policy_version_max) for o in outs] == [(0, 0), (0, 0)]


def test_long_prefills_neither_count_against_the_budget_nor_wait():
    from torchtitan_rl.generation.block_manager import BlockManager
    from torchtitan_rl.generation.scheduler import Scheduler

    sched = Scheduler(BlockManager(64, 4, enable_prefix_cache=False), max_num_seqs=8)
    sched.waiting.extend([queued("a", 8), queued("long", 40), queued("b", 8), queued("c", 8)])
    got = sched.admit(0.0, max_new_tokens=17, long_prefill=32)
    assert [r.request_id for r in got] == ["a", "long", "b"]
