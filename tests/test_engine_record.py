"""`Engine._record`: what the sampler returned at each step ends up in the completions,
bit for bit, as a reference that replays the sampler's outputs by the finish rules finds
it (stop tokens, stop sequences, max_tokens, the context limit, support masks), with
look-ahead, greedy and filtered rows and preemption; and a row whose token count is not the
position its draw was keyed by fails the step loudly (`SamplingRows` moves a kept row's
position on by one per step, assuming each live row recorded one token)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from fakes import tiny_qwen3
from test_engine import prompt, run

from torchtitan_rl.generation import engine as engine_module
from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.types import FinishReason, SamplingParams

MAX_SEQ_LEN = 40


def params(i: int) -> SamplingParams:
    """Eighteen seeded requests: sampled, greedy, top-k and top-p rows asking for their
    support, stop sequences, and rows that run into the context limit."""
    base = SamplingParams(
        max_tokens=6 + 3 * (i % 5), seed=100 + i, stop_token_ids=tuple(range(i % 3, 97, 13))
    )
    return [
        base,
        replace(base, temperature=0.0),
        replace(base, top_k=7, return_support=True),
        replace(base, top_p=0.8, temperature=0.7, return_support=True),
        replace(base, stop_sequences=((88, 88), (13, 12), (40,)), stop_token_ids=()),
        replace(base, max_tokens=60, stop_token_ids=()),
    ][i % 6]


def sampler_log(e: Engine, monkeypatch) -> list:
    """Records every step's rows (request id, prompt length, settings) and the sampler's
    outputs for them, as the sampler returned them."""
    log = []
    sample = engine_module.sample_tokens

    def logged(logits_NV, **kwargs):
        out = sample(logits_NV, **kwargs)
        rows = [(r.request_id, len(r.prompt_ids), r.sampling) for r in e._rows.requests]
        support = [s.clone() for s in out.support] if out.support is not None else None
        log.append((rows, out.token_ids_N.clone(), out.logprobs_N.clone(), support))
        return out

    monkeypatch.setattr(engine_module, "sample_tokens", logged)
    return log


def reason_of(ids: list[int], n_prompt: int, s: SamplingParams) -> FinishReason | None:
    if ids[-1] in s.stop_token_ids or any(ids[-len(q) :] == list(q) for q in s.stop_sequences):
        return FinishReason.STOP
    if len(ids) >= s.max_tokens or n_prompt + len(ids) >= MAX_SEQ_LEN:
        return FinishReason.LENGTH
    return None


def replay(log: list) -> dict[str, dict]:
    """Each request's tokens, log-probs, supports and finish reason from the sampler's
    outputs alone: a row appends its token until its request has finished (later rows, a
    look-ahead's, are dropped)."""
    done: dict[str, dict] = {}
    for rows, tokens_N, logprobs_N, support in log:
        for i, (key, n_prompt, s) in enumerate(rows):
            rec = done.setdefault(key, dict(ids=[], lps=[], support=[], reason=None))
            if rec["reason"] is not None:
                continue
            rec["ids"].append(int(tokens_N[i]))
            rec["lps"].append(float(logprobs_N[i]))
            if s.return_support:
                rec["support"].append(support[i].numpy())
            rec["reason"] = reason_of(rec["ids"], n_prompt, s)
    return done


@pytest.mark.parametrize("look_ahead", [False, True], ids=["one_at_a_time", "look_ahead"])
@pytest.mark.parametrize("tight", [False, True], ids=["ample_cache", "tight_cache"])
def test_completions_are_the_sampler_outputs_cut_by_the_finish_rules(
    look_ahead, tight, monkeypatch
):
    cache = dict(block_size=4, num_blocks=16) if tight else {}
    config = EngineConfig(max_num_seqs=5, max_seq_len=MAX_SEQ_LEN, **cache)
    e = Engine(tiny_qwen3(), config, look_ahead=look_ahead, threaded=False, steps_per_yield=3)
    log = sampler_log(e, monkeypatch)
    prompts = [prompt(3 + i % 7, offset=i) for i in range(18)]

    async def main():
        outs = await asyncio.gather(
            *(e.generate(p, request_id=str(i), sampling=params(i)) for i, p in enumerate(prompts))
        )
        await e.close()
        return outs

    outs = run(main())
    want = replay(log)
    reasons = set()
    for out in outs:
        ref = want[out.request_id]
        assert out.error is None and out.finish_reason == ref["reason"]
        assert out.token_ids_N.dtype == np.int32 and out.token_ids_N.tolist() == ref["ids"]
        assert out.logprobs_N.dtype == np.float32
        assert out.logprobs_N.tobytes() == np.asarray(ref["lps"], np.float32).tobytes()
        if params(int(out.request_id)).return_support:
            sizes = [len(s) for s in ref["support"]]
            assert out.support_offsets.tolist() == np.cumsum([0, *sizes]).tolist()
            assert out.support_ids.tobytes() == np.concatenate(ref["support"]).tobytes()
        else:
            assert out.support_ids is None
        i = int(out.request_id)
        rule = "sequence" if params(i).stop_sequences else "token"
        if out.finish_reason == FinishReason.LENGTH:
            rule = "context" if len(prompts[i]) + out.num_tokens == MAX_SEQ_LEN else "max_tokens"
        reasons.add((out.finish_reason, rule))
    assert reasons == {
        (FinishReason.STOP, "token"),
        (FinishReason.STOP, "sequence"),
        (FinishReason.LENGTH, "max_tokens"),
        (FinishReason.LENGTH, "context"),
    }
    if tight:
        assert sum(c.metrics["generator/preemptions"] for c in outs) > 0
    if look_ahead:
        assert e.stats["steps"] > e.stats["drained_steps"]


def running_engine(n: int):
    """An inline engine with `n` seeded requests admitted (no step run yet)."""
    config = EngineConfig(max_num_seqs=4, max_seq_len=MAX_SEQ_LEN)
    e = Engine(tiny_qwen3(), config, look_ahead=False, threaded=False)
    loop = asyncio.new_event_loop()
    for i in range(n):
        sampling = SamplingParams(max_tokens=20, seed=i)
        e._enqueue(str(i), prompt(4, offset=i).tolist(), sampling, loop.create_future(), 0.0)
    e._admit()
    return e, loop


def test_a_row_that_recorded_two_tokens_in_one_step_fails_the_next_step():
    e, loop = running_engine(3)
    e._step(look_ahead=False)
    e._step(look_ahead=False)
    e._sched.running[1].token_ids.append(7)  # its next draw would be keyed one step behind
    with pytest.raises(AssertionError, match="request 1 sampled at position 2 with 3 tokens"):
        e._step(look_ahead=False)
    loop.close()


def test_a_step_whose_tokens_were_never_recorded_fails_the_next_record():
    e, loop = running_engine(3)
    e._step(look_ahead=False)
    rows = list(e._sched.running)
    logits_NV = torch.randn(3, e.vocab_size)
    e._launch_sample(rows, logits_NV)  # sampled, never recorded: positions moved on
    sampled = e._launch_sample(rows, logits_NV)
    with pytest.raises(AssertionError, match="request 0 sampled at position 2 with 1 tokens"):
        e._record(rows, sampled, 0)
    loop.close()
