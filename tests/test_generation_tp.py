"""Generator tensor parallelism over 2 CPU ranks (gloo): lockstep output equals TP=1."""

import asyncio
import queue
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_engine import GREEDY, make_engine, prompt, run, tiny_qwen3

from torchtitan_rl.generation.engine import Engine, EngineConfig
from torchtitan_rl.generation.tp import TensorParallel, run_follower
from torchtitan_rl.types import SamplingParams

CONFIG = dict(max_num_seqs=4, max_seq_len=48, max_steps_per_iteration=2, block_size=4)
SAMPLINGS = [
    replace(GREEDY, max_tokens=10),
    SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=5),
    replace(GREEDY, max_tokens=6),
]
PROMPTS = [prompt(n, i) for i, n in enumerate([7, 3, 12])]


async def serve(engine: Engine):
    first = await asyncio.gather(
        *(
            engine.generate(p, request_id=str(i), sampling=s)
            for i, (p, s) in enumerate(zip(PROMPTS, SAMPLINGS))
        )
    )
    engine.load_weights(tiny_qwen3(1).state_dict(), version=1)
    second = await engine.generate(PROMPTS[0], request_id="after", sampling=SAMPLINGS[0])
    await engine.close()
    return [*first, second]


def _rank_main(rank: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        tp = TensorParallel()
        config = EngineConfig(**CONFIG)
        if rank == 0:
            outs = asyncio.run(serve(Engine(tiny_qwen3(), config, tp=tp)))
            torch.save(
                [(c.token_ids_N, c.logprobs_N, c.policy_version_max) for c in outs], out_file
            )
        else:
            weights: queue.Queue = queue.Queue()
            weights.put((tiny_qwen3(1).state_dict(), 1))
            run_follower(tiny_qwen3(), config, tp, weights)
    finally:
        dist.destroy_process_group()


def test_tp2_lockstep_matches_tp1(tmp_path):
    out_file = str(tmp_path / "tp2.pt")
    # fork: the ranks inherit the imported modules (a spawn re-imports torch, ~10 s).
    mp.start_processes(
        _rank_main, args=(str(tmp_path / "init"), out_file), nprocs=2, start_method="fork"
    )
    tp2 = torch.load(out_file, weights_only=False)
    tp1 = run(serve(make_engine(**CONFIG)))
    assert len(tp2) == len(tp1) == 4
    for (ids, logprobs, version), ref in zip(tp2, tp1):
        np.testing.assert_array_equal(ids, ref.token_ids_N)
        np.testing.assert_allclose(logprobs, ref.logprobs_N, atol=1e-5, rtol=0)
        assert version == ref.policy_version_max
