"""Benchmark: the engine's batch-invariant steps against the batch-dependent path.

    python scripts/bench_batch_invariance.py            # CPU: 64 requests x 48 tokens, tiny model
    python scripts/bench_batch_invariance.py --smoke    # CPU: 8 requests x 8 tokens, one round
    python scripts/bench_batch_invariance.py --cuda     # GPU: Qwen3-0.6B shape, bf16 (~3 min)
    python scripts/bench_batch_invariance.py --cuda --smoke   # GPU: tiny model, seconds

Seconds to generate one batch of seeded requests (prompts of 40-46 tokens, temperature 1,
inline driver, one torch thread) with the native engine on CPU, rows alternated over
`--rounds` rounds (median): `batch-dependent` is the engine's padded prefill and
batch-wide decode attention (`ModelRunner.batch_invariant = False`, the path before
2026-11-28); `invariant` is the default CPU path (generation/batch_invariant.py: every step
one packed step, attention per exact context width); `invariant, widths / k` rounds widths
up to k blocks (fewer, wider groups). No physical floor is given: the rows do the same
model work and differ in how it is batched. Writes JSON to --out ($OUT, else .).

`--cuda` (scripts/batch_invariance_cuda.py) compares `generator.batch_invariant` off and on
with the native engine on one GPU: a decode pattern (all requests at once) and a mixed one
(a request arrives every `--every` engine steps while the others decode).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from torchtitan_rl.generation import model_runner
from torchtitan_rl.generation.batch_invariant import width_groups
from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.models.qwen3 import ModelConfig, build_model
from torchtitan_rl.types import SamplingParams

VOCAB = 97
ROWS = {"batch-dependent": (False, 1), "invariant": (True, 1),
        "invariant, widths / 4": (True, 4), "invariant, widths / 32": (True, 32)}  # fmt: skip
"""Row -> (batch_invariant, widths rounded up to this many blocks)."""


def one_batch(invariant: bool, round_to: int, requests: int, tokens: int) -> float:
    torch.manual_seed(0)
    model = build_model(ModelConfig(), VOCAB, torch.device("cpu"))
    engine = Engine(model, EngineConfig(max_num_seqs=128, max_seq_len=512), threaded=False)
    engine.runner.batch_invariant = invariant
    model_runner.width_groups = functools.partial(width_groups, round_to=round_to)
    prompts = [((np.arange(40 + i % 7) * 7 + i) % VOCAB).astype(np.int32) for i in range(requests)]

    async def main() -> float:
        start = time.perf_counter()
        await asyncio.gather(
            *(
                engine.generate(
                    p,
                    request_id=str(i),
                    sampling=SamplingParams(temperature=1.0, max_tokens=tokens, seed=i),
                )  # fmt: skip
                for i, p in enumerate(prompts)
            )
        )
        seconds = time.perf_counter() - start
        await engine.close()
        return seconds

    try:
        return asyncio.run(main())
    finally:
        model_runner.width_groups = width_groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=0, help="output tokens (0: 48, --cuda 128)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--cuda", action="store_true", help="the GPU mode (batch_invariance_cuda.py)")
    p.add_argument("--prompt-len", type=int, default=128, help="--cuda: prompt tokens")
    p.add_argument("--every", type=int, default=2, help="--cuda: steps between arrivals (mixed)")
    args = p.parse_args()
    args.tokens = args.tokens or (128 if args.cuda else 48)
    if args.smoke:
        args.requests, args.tokens, args.rounds, args.prompt_len = 8, 8, 1, 16
    if args.cuda:
        try:  # python -m scripts.bench_batch_invariance, or scripts/ on the path
            from scripts.batch_invariance_cuda import run_cuda
        except ModuleNotFoundError:
            from batch_invariance_cuda import run_cuda

        run_cuda(args)
        return
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    for _ in range(args.rounds):
        for row, (invariant, round_to) in ROWS.items():
            times[row].append(one_batch(invariant, round_to, args.requests, args.tokens))
    base = statistics.median(times["batch-dependent"])
    print(f"{args.requests} requests x {args.tokens} tokens, median of {args.rounds}")
    print("| row | seconds | vs batch-dependent |\n|---|---|---|")
    for row, values in times.items():
        print(
            f"| {row} | {statistics.median(values):.3f} | {statistics.median(values) / base:.2f}x |"
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_batch_invariance.json").write_text(json.dumps(times, indent=1))


if __name__ == "__main__":
    main()
