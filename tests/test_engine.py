import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from fakes import tiny_qwen3

from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.types import FinishReason, SamplingParams

VOCAB = 97


GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def make_engine(*, threaded: bool = False, steps_per_yield: int = 2, **overrides) -> Engine:
    """An engine on the inline driver by default: tests place weight loads between given
    steps (the threaded driver has its own tests)."""
    config = EngineConfig(max_num_seqs=4, max_seq_len=48)
    for key, value in overrides.items():
        setattr(config, key, value)
    return Engine(tiny_qwen3(), config, threaded=threaded, steps_per_yield=steps_per_yield)


def prompt(n: int, offset: int = 0) -> np.ndarray:
    return ((np.arange(n) * 7 + offset) % VOCAB).astype(np.int32)


async def yield_loop(times: int) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.0, max_tokens=10),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=30, max_tokens=10),
    ],
    ids=["greedy", "seeded_sampling"],
)
def test_continuous_batching_matches_one_at_a_time_generation(sampling):
    prompts = [prompt(n, offset=i) for i, n in enumerate([3, 11, 1, 7, 5, 9])]

    def request(i):
        return replace(sampling, seed=100 + i, max_tokens=sampling.max_tokens + i)

    async def batched():
        engine = make_engine(max_num_seqs=3)  # six requests, three slots: some wait
        outs = await asyncio.gather(
            *(
                engine.generate(p, request_id=str(i), sampling=request(i))
                for i, p in enumerate(prompts)
            )
        )
        await engine.close()
        return outs

    async def one_at_a_time():
        engine = make_engine(max_num_seqs=1)
        outs = [
            await engine.generate(p, request_id=str(i), sampling=request(i))
            for i, p in enumerate(prompts)
        ]
        await engine.close()
        return outs

    for got, ref in zip(run(batched()), run(one_at_a_time())):
        assert got.finish_reason == ref.finish_reason == FinishReason.LENGTH
        np.testing.assert_array_equal(got.token_ids_N, ref.token_ids_N)
        np.testing.assert_allclose(got.logprobs_N, ref.logprobs_N, atol=1e-5)


def test_logprobs_match_full_forward_log_softmax():
    reference = tiny_qwen3()
    sampling = SamplingParams(temperature=1.0, max_tokens=15, seed=3)

    async def main():
        engine = make_engine()
        outs = await asyncio.gather(
            *(engine.generate(prompt(n, n), request_id=str(n), sampling=sampling) for n in (2, 9))
        )
        await engine.close()
        return outs

    for n, out in zip((2, 9), run(main())):
        tokens = torch.from_numpy(np.concatenate([prompt(n, n), out.token_ids_N])).long()
        with torch.no_grad():
            logprobs_TV = torch.log_softmax(reference(tokens[None])[0].double(), dim=-1)
        expected = logprobs_TV[n - 1 : -1].gather(1, tokens[n:, None]).squeeze(1)
        np.testing.assert_allclose(out.logprobs_N, expected.numpy(), atol=1e-5)
        assert out.token_ids_N.dtype == np.int32 and out.logprobs_N.dtype == np.float32


def test_request_submitted_while_others_run_joins_the_batch_and_completes():
    async def main():
        engine = make_engine(steps_per_yield=1)
        long = [
            asyncio.create_task(
                engine.generate(prompt(5, i), request_id=f"long{i}", sampling=GREEDY)
            )
            for i in range(2)
        ]
        await yield_loop(4)
        late = await engine.generate(
            prompt(4, 9), request_id="late", sampling=replace(GREEDY, max_tokens=3)
        )
        assert not all(t.done() for t in long)  # it finished while the others were running
        await asyncio.gather(*long)
        await engine.close()
        return late

    late = run(main())
    assert late.num_tokens == 3
    assert late.metrics["generator/inflight_at_completion"] == 3
    for key in ("queue_time_ms", "time_to_first_token_ms", "decode_time_ms"):
        assert late.metrics[f"generator/{key}"] >= 0


def test_stop_token_ends_request_with_stop_and_is_kept():
    async def main():
        engine = make_engine()
        free = await engine.generate(prompt(6), request_id="free", sampling=GREEDY)
        stop_token = int(free.token_ids_N[3])
        stopped = await engine.generate(
            prompt(6), request_id="stopped", sampling=replace(GREEDY, stop_token_ids=(stop_token,))
        )
        await engine.close()
        return free, stopped, stop_token

    free, stopped, stop_token = run(main())
    first = list(free.token_ids_N).index(stop_token)
    assert stopped.finish_reason == FinishReason.STOP
    np.testing.assert_array_equal(stopped.token_ids_N, free.token_ids_N[: first + 1])
    assert stopped.token_ids_N[-1] == stop_token


def test_stop_sequence_ends_request_with_stop_once_its_ids_end_the_completion():
    async def main():
        engine = make_engine()
        free = await engine.generate(prompt(6), request_id="free", sampling=GREEDY)
        seq = tuple(int(t) for t in free.token_ids_N[2:4])
        never = (int(free.token_ids_N[3]), int(free.token_ids_N[2]))  # the pair reversed
        stopped = await engine.generate(
            prompt(6), request_id="stopped", sampling=replace(GREEDY, stop_sequences=(seq,))
        )
        other = await engine.generate(
            prompt(6), request_id="other", sampling=replace(GREEDY, stop_sequences=(never,))
        )
        await engine.close()
        return free, stopped, other, seq

    free, stopped, other, seq = run(main())
    ids = [int(t) for t in free.token_ids_N]
    end = next(i + 2 for i in range(len(ids) - 1) if tuple(ids[i : i + 2]) == seq)
    assert stopped.finish_reason == FinishReason.STOP
    np.testing.assert_array_equal(stopped.token_ids_N, free.token_ids_N[:end])
    assert len(stopped.logprobs_N) == end
    if all(tuple(ids[i : i + 2]) != (seq[1], seq[0]) for i in range(len(ids) - 1)):
        np.testing.assert_array_equal(other.token_ids_N, free.token_ids_N)


def test_max_tokens_and_context_limit_end_request_with_length():
    async def main():
        engine = make_engine(max_seq_len=20)
        by_tokens = await engine.generate(prompt(4), request_id="a", sampling=GREEDY)
        by_context = await engine.generate(prompt(17), request_id="b", sampling=GREEDY)
        longest_prompt = await engine.generate(prompt(19), request_id="c", sampling=GREEDY)
        await engine.close()
        return by_tokens, by_context, longest_prompt

    by_tokens, by_context, longest_prompt = run(main())
    assert by_tokens.finish_reason == FinishReason.LENGTH and by_tokens.num_tokens == 12
    assert by_context.finish_reason == FinishReason.LENGTH and by_context.num_tokens == 3
    assert longest_prompt.finish_reason == FinishReason.LENGTH and longest_prompt.num_tokens == 1


def test_invalid_requests_return_error_completions_while_others_succeed():
    bad = {
        "too_long": (prompt(48), GREEDY),
        "empty": (prompt(0), GREEDY),
        "out_of_vocab": (np.array([1, VOCAB], dtype=np.int32), GREEDY),
        "two_dims": (prompt(4).reshape(2, 2), GREEDY),
        "bad_top_p": (prompt(4), SamplingParams(top_p=0.0)),
        "bad_max_tokens": (prompt(4), SamplingParams(max_tokens=0)),
        "nan_temperature": (prompt(4), SamplingParams(temperature=float("nan"))),
    }

    async def main():
        engine = make_engine()
        good = [
            engine.generate(prompt(5, i), request_id=f"ok{i}", sampling=GREEDY) for i in range(2)
        ]
        errs = [engine.generate(p, request_id=name, sampling=s) for name, (p, s) in bad.items()]
        outs = await asyncio.gather(*good, *errs)
        await engine.close()
        return outs[:2], outs[2:]

    good, errs = run(main())
    assert all(c.finish_reason == FinishReason.LENGTH and c.num_tokens == 12 for c in good)
    for name, c in zip(bad, errs):
        assert c.request_id == name and c.finish_reason == FinishReason.ERROR
        assert c.error and c.num_tokens == 0
    assert errs[0].error == (
        "a prompt of 48 tokens does not fit generator.max_seq_len=48 (at most 47 prompt "
        "tokens); raise generator.max_seq_len"
    )
    assert errs[1].error == "prompt_ids is empty" and "top_p" in errs[4].error
    assert errs[6].error == "sampling: temperature must be finite and >= 0, got nan"


def test_load_weights_mid_run_changes_later_logprobs_and_reports_version_range():
    new_state = tiny_qwen3(seed=1).state_dict()
    sampling = replace(GREEDY, max_tokens=20)

    async def main(swap: bool):
        engine = make_engine(steps_per_yield=1)
        task = asyncio.create_task(engine.generate(prompt(5), request_id="r", sampling=sampling))
        await yield_loop(6)
        if swap:
            engine.load_weights(new_state, version=1)
        out = await task
        version = engine.policy_version
        await engine.close()
        return out, version

    base, _ = run(main(swap=False))
    swapped, version = run(main(swap=True))
    assert version == 1
    assert swapped.policy_version_min == 0 and swapped.policy_version_max == 1
    assert base.policy_version_min == base.policy_version_max == 0
    np.testing.assert_allclose(swapped.logprobs_N[:2], base.logprobs_N[:2], atol=1e-6)
    assert np.abs(swapped.logprobs_N[-5:] - base.logprobs_N[-5:]).max() > 1e-3


def test_load_weights_before_first_request_applies_immediately():
    engine = make_engine()
    engine.load_weights(tiny_qwen3(seed=1).state_dict(), version=7)
    assert engine.policy_version == 7
    out = run(engine.generate(prompt(3), request_id="r", sampling=GREEDY))
    assert out.policy_version_min == out.policy_version_max == 7


def test_close_fails_running_and_queued_requests_without_hanging():
    async def main():
        engine = make_engine(max_num_seqs=1, steps_per_yield=1)
        slow = replace(GREEDY, max_tokens=40)
        tasks = [
            asyncio.create_task(engine.generate(prompt(3, i), request_id=str(i), sampling=slow))
            for i in range(3)
        ]
        await yield_loop(3)
        await asyncio.wait_for(engine.close(), timeout=5)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=5)
        with pytest.raises(RuntimeError, match="engine closed"):
            await engine.generate(prompt(3), request_id="after", sampling=GREEDY)
        return results

    results = run(main())
    assert all(isinstance(r, RuntimeError) and "engine closed" in str(r) for r in results)


def test_cancelled_request_frees_its_slot_for_the_next():
    async def main():
        engine = make_engine(max_num_seqs=1, steps_per_yield=1)
        with pytest.raises(TimeoutError):
            slow = replace(GREEDY, max_tokens=40)
            await asyncio.wait_for(
                engine.generate(prompt(3), request_id="slow", sampling=slow), 0.001
            )
        out = await engine.generate(prompt(3), request_id="next", sampling=GREEDY)
        await engine.close()
        return out

    assert run(main()).num_tokens == 12


def test_return_support_gives_csr_of_kept_ids_per_token():
    sampling = SamplingParams(temperature=0.8, top_k=5, max_tokens=6, seed=1, return_support=True)

    async def main():
        engine = make_engine()
        out = await engine.generate(prompt(4), request_id="r", sampling=sampling)
        plain = await engine.generate(prompt(4), request_id="p", sampling=GREEDY)
        await engine.close()
        return out, plain

    out, plain = run(main())
    assert out.support_offsets.tolist() == [5 * i for i in range(7)]
    assert out.support_ids.dtype == np.int32 and plain.support_ids is None
    for i, token in enumerate(out.token_ids_N):
        kept = out.support_ids[out.support_offsets[i] : out.support_offsets[i + 1]]
        assert token in kept and list(kept) == sorted(kept)


def test_engine_config_rejects_bad_values_naming_the_field():
    for field, value in [
        ("max_num_seqs", 0),
        ("max_seq_len", 1),
        ("dtype", "fp8"),
    ]:
        config = EngineConfig()
        setattr(config, field, value)
        with pytest.raises(ValueError, match=field):
            config.validate()
