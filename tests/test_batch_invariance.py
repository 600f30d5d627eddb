"""On CPU a request's tokens and log-probs are the same bits whatever shares its steps:
alone, with others, staggered over steps, in another order, behind a cached prefix
(generation/batch_invariant.py). The default job's seeded replay rests on this."""

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from fakes import tiny_qwen3
from test_model_runner import VOCAB, make_runner

from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.generation.model_runner import SeqInput
from torchtitan_rl.types import SamplingParams

PROMPTS = [((np.arange(n) * 7 + i) % VOCAB).astype(np.int32) for i, n in enumerate(
    [5, 17, 3, 40, 9, 23, 9, 12])]  # fmt: skip
PROMPTS[6] = PROMPTS[4].copy()  # a group: the same prompt twice
BASE = SamplingParams(temperature=1.0, max_tokens=20)
SAMPLINGS = [replace(BASE, seed=i, max_tokens=12 + 3 * (i % 3)) for i in range(len(PROMPTS))]
SAMPLINGS[2] = replace(SAMPLINGS[2], temperature=0.0)
SAMPLINGS[5] = replace(SAMPLINGS[5], top_p=0.9, top_k=20)


def engine(max_num_seqs=8, threaded=False, **changes) -> Engine:
    torch.manual_seed(0)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_seq_len=96, block_size=4, **changes)
    return Engine(tiny_qwen3(), config, threaded=threaded, steps_per_yield=1)


async def together(e, order):
    outs = await asyncio.gather(
        *(e.generate(PROMPTS[i], request_id=str(i), sampling=SAMPLINGS[i]) for i in order)
    )
    await e.close()
    return dict(zip(order, outs))


async def staggered(e, order, gap_s):
    tasks = {}
    for i in order:
        tasks[i] = asyncio.ensure_future(
            e.generate(PROMPTS[i], request_id=str(i), sampling=SAMPLINGS[i])
        )
        await asyncio.sleep(gap_s)
    outs = {i: await t for i, t in tasks.items()}
    await e.close()
    return outs


async def behind_a_cached_prefix(e, order):
    """A longer request with the same start runs first: later prompts hit its blocks."""
    warm = np.concatenate([PROMPTS[3], PROMPTS[3][:5]])
    await e.generate(warm, request_id="warm", sampling=replace(BASE, max_tokens=4, seed=99))
    return await together(e, order)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def test_every_request_gets_the_same_bits_in_any_company():
    order = list(range(len(PROMPTS)))
    ref = run(together(engine(), order))
    variants = {
        "one at a time": run(together(engine(max_num_seqs=1), order)),
        "reversed": run(together(engine(), order[::-1])),
        "threaded, staggered": run(staggered(engine(threaded=True), order, 0.003)),
        "three slots, shuffled": run(together(engine(max_num_seqs=3), [5, 0, 7, 2, 6, 1, 4, 3])),
        "behind a cached prefix": run(behind_a_cached_prefix(engine(), order)),
        "tight cache (preemption)": run(together(engine(num_blocks=40), order)),
        # generator.batch_invariant switches CUDA kernels; CPU steps always are invariant
        "batch_invariant key on": run(together(engine(batch_invariant=True), order)),
    }
    assert any(c.metrics["generator/prefix_hit_tokens"] > 0
               for c in variants["behind a cached prefix"].values())  # fmt: skip
    assert any(c.metrics["generator/preemptions"] > 0
               for c in variants["tight cache (preemption)"].values())  # fmt: skip
    for name, got in variants.items():
        for i in order:
            np.testing.assert_array_equal(got[i].token_ids_N, ref[i].token_ids_N, err_msg=name)
            np.testing.assert_array_equal(got[i].logprobs_N, ref[i].logprobs_N, err_msg=name)


@pytest.mark.parametrize("others", [1, 15, 16, 40])
def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(others):
    """Row: its 30th token after 29 cached ones. Beside it: decode rows with longer
    contexts, and a prefill row."""
    torch.manual_seed(0)
    runner = make_runner(tiny_qwen3(), num_blocks=96, max_seq_len=64)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (64,), generator=gen).tolist()
    table = list(range(8))
    runner.forward([SeqInput(token_ids=tokens[:29], start=0, block_table=table)])
    row = SeqInput(token_ids=[tokens[29]], start=29, block_table=table)
    alone = runner.forward([row]).clone()
    beside = [
        SeqInput(token_ids=[tokens[i % 64]], start=40 + i % 20, block_table=list(range(16, 32)))
        for i in range(others - 1)
    ]
    beside.append(SeqInput(token_ids=tokens[:21], start=0, block_table=list(range(40, 48))))
    mixed = runner.forward([*beside[: others // 2], row, *beside[others // 2 :]])
    assert torch.equal(mixed[others // 2], alone[0])
