"""The packed step (`ModelRunner.packed_step`): decode rows and prefill rows in one token
list give the logits of separate prefill and decode, against a float64 full forward; on a
GPU its CUDA graphs of mixed steps match it eagerly and the engine's completions."""

import asyncio

import pytest
import torch
from fakes import tiny_qwen3
from test_model_runner import VOCAB, full_forward_logits, make_runner

from torchtitan_rl.generation.cuda_graphs import MixedGraphs, token_buckets
from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.generation.model_runner import ModelRunner, SeqInput
from torchtitan_rl.types import SamplingParams


def mixed_batch(seqs):
    """Row a decodes its 9th token; b prefills 9 tokens at once; c shares b's first two
    blocks (which b writes in this very step) and feeds its last token; d prefills 3
    tokens after 2 cached ones."""
    a, b, d = seqs
    return [
        SeqInput(token_ids=[a[8]], start=8, block_table=[0, 1, 2]),
        SeqInput(token_ids=b[:9], start=0, block_table=[5, 6, 7]),
        SeqInput(token_ids=[b[8]], start=8, block_table=[5, 6, 9]),
        SeqInput(token_ids=d[2:5], start=2, block_table=[3, 4]),
    ]


def prefill_earlier(runner, seqs):
    """What the cache holds before the mixed step: a's first 8 tokens, d's first 2."""
    a, _, d = seqs
    runner.forward([SeqInput(token_ids=a[:8], start=0, block_table=[0, 1, 2])])
    runner.forward([SeqInput(token_ids=d[:2], start=0, block_table=[3, 4])])


def packed(runner, batch, last_only=True):
    tokens_M, pos_M, table_MN, last_R = runner.packed_inputs(
        batch, sum(len(s.token_ids) for s in batch) + 3, len(batch), 3
    )
    return runner.packed_step(tokens_M, pos_M, table_MN, last_R if last_only else None)


def test_packed_mixed_step_matches_a_float64_full_forward_and_the_padded_path():
    torch.manual_seed(0)
    model = tiny_qwen3()
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (9,), generator=gen).tolist() for _ in range(3)]
    runner = make_runner(model, dtype=torch.float64)
    prefill_earlier(runner, seqs)
    batch = mixed_batch(seqs)
    got_RV = packed(runner, batch)
    reference = tiny_qwen3().double()
    reference.load_state_dict(runner.model.state_dict())
    a, b, d = seqs
    ref_RV = torch.stack(
        [
            full_forward_logits(reference, torch.tensor(a))[8],
            full_forward_logits(reference, torch.tensor(b))[8],
            full_forward_logits(reference, torch.tensor(b))[8],
            full_forward_logits(reference, torch.tensor(d[:5]))[4],
        ]
    ).float()
    # computed in float64 throughout; the runner hands logits out in fp32
    torch.testing.assert_close(got_RV, ref_RV, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        torch.log_softmax(got_RV.double(), -1),
        torch.log_softmax(ref_RV.double(), -1),
        atol=1e-6,
        rtol=1e-6,
    )
    # the same cache state, through the padded path (prefill rows) and the decode path
    separate = make_runner(reference.float(), dtype=torch.float64)
    separate.batch_invariant = False
    prefill_earlier(separate, seqs)
    torch.testing.assert_close(separate.forward(batch), got_RV, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        separate._forward_padded(batch[1:]), got_RV[1:], atol=1e-6, rtol=1e-6
    )


def test_packed_step_padding_tokens_touch_only_the_scratch_block():
    torch.manual_seed(0)
    runner = make_runner(tiny_qwen3())
    seqs = [list(range(1, 10)), list(range(20, 29)), list(range(40, 49))]
    prefill_earlier(runner, seqs)
    before = [k.clone() for k in runner.kv_cache.k_L]
    batch = mixed_batch(seqs)
    packed(runner, batch)  # 3 padding tokens
    bs = runner.block_size
    written = {b * bs + p % bs for s in batch for p in range(s.start, s.start + len(s.token_ids))
               for b in [s.block_table[p // bs]]}  # fmt: skip
    for layer, k in enumerate(runner.kv_cache.k_L):
        changed = (k != before[layer]).any(dim=(0, 2)).nonzero().flatten().tolist()
        scratch = range(runner.scratch_block * bs, (runner.scratch_block + 1) * bs)
        assert set(changed) - written <= set(scratch)


def test_token_buckets_cover_every_count_up_to_the_largest():
    assert token_buckets(2048)[:5] == [32, 64, 128, 256, 512]
    assert token_buckets(2048)[-1] == 2048 and token_buckets(600)[-1] == 600
    assert token_buckets(600) == sorted(set(token_buckets(600)))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_mixed_step_graphs_match_the_eager_packed_step_and_the_cpu_runner():
    torch.manual_seed(0)
    state = tiny_qwen3().state_dict()
    seqs = [list(range(1, 10)), list(range(20, 29)), list(range(40, 49))]
    cpu = make_runner(tiny_qwen3())
    gpu_runner = ModelRunner(
        tiny_qwen3(), num_blocks=16, block_size=4, max_seq_len=32, device="cuda",
        dtype=torch.float32, decode_attention="triton",
    )  # fmt: skip
    for runner in (cpu, gpu_runner):
        runner.load_state_dict(state)
        prefill_earlier(runner, seqs)
    gpu_runner.compile_decode()
    graphs = MixedGraphs(gpu_runner, max_rows=8, max_tokens=64)
    batch = mixed_batch(seqs)
    ref = cpu.forward(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = graphs.run(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)
    # device-resident tokens of the first row override its token_ids
    tokens_D = torch.tensor([seqs[0][8]], device="cuda")
    wrong = [SeqInput(token_ids=[0], start=8, block_table=[0, 1, 2]), *batch[1:]]
    torch.testing.assert_close(graphs.run(wrong, tokens_D).cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@gpu
def test_cuda_engine_with_mixed_step_graphs_gives_the_eager_engines_tokens():
    prompts = [list(range(i + 1, i + 4 + 3 * i)) for i in range(10)]
    sampling = [SamplingParams(temperature=1.0, max_tokens=6 + i, seed=i) for i in range(10)]

    async def main(cuda_graphs: bool):
        config = EngineConfig(max_num_seqs=6, max_seq_len=64, cuda_graphs=cuda_graphs)
        torch.manual_seed(0)
        e = Engine(tiny_qwen3(), config, "cuda")
        tasks = []
        for i, (p, s) in enumerate(zip(prompts, sampling)):
            tasks.append(asyncio.ensure_future(e.generate(p, request_id=str(i), sampling=s)))
            await asyncio.sleep(0.002)  # arrivals while others run: mixed steps
        outs = await asyncio.gather(*tasks)
        await e.close()
        return outs, e.stats

    (got, stats), (ref, _) = asyncio.run(main(True)), asyncio.run(main(False))
    assert stats["prefill_rows_joined"] > 0
    for a, b in zip(got, ref):
        assert a.token_ids_N.tolist() == b.token_ids_N.tolist()
        torch.testing.assert_close(
            torch.from_numpy(a.logprobs_N), torch.from_numpy(b.logprobs_N), atol=1e-3, rtol=0
        )
