"""The GPU mode of scripts/bench_batch_invariance.py (`--cuda`): `generator.batch_invariant`
off and on, with the native engine on one GPU (CUDA graphs on, look-ahead on, prefix cache
off: random prompts share nothing).

Model: Qwen3-0.6B shape, random bf16 weights (`--smoke`: the tiny fp32 model). Requests:
`--requests` random prompts of `--prompt-len` tokens, `--tokens` output tokens each
(temperature 1, no stop tokens, seeded), two patterns over the same requests:

- decode: all submitted at once; output tokens/s (prefill included) and decode tokens/s
  (tokens after each request's first over the time after the last first token);
- mixed: one request arrives every `--every` engine steps while the others decode, so
  most steps hold a prefill beside decode rows (the RL loop's pattern); seconds and
  output tokens/s.

Rows: "default" (torch.compile'd layers, cuBLAS, fused sampler: batch-dependent) and
"batch-invariant" (generation/invariant_kernels.py); "memory-bandwidth bound" (weights and
keys/values read once per decode step at the copy bandwidth, as scripts/bench_generate.py)
is the decode pattern's physical floor. Each row's engine is built once (graph capture,
compile: `setup_s`), then the patterns run `--rounds` times alternately (median). Also
reported: the device time of one decode graph replay at the largest batch, and whether each
row gives every request the same bits in both patterns (the invariant row must: "yes").
Writes bench_batch_invariance_cuda.json to --out.
"""

from __future__ import annotations

import asyncio
import gc
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torchtitan.models.qwen3 import Qwen3ModelArgs, qwen3_args

from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.types import SamplingParams

try:  # python -m scripts.bench_batch_invariance, or the repository root on the path
    from scripts.bench_generate import (
        SMOKE_ARGS,
        bandwidth_bound,
        build_model,
        copy_bandwidth,
        time_graph_replays,
    )
except ModuleNotFoundError:  # python scripts/bench_batch_invariance.py
    from bench_generate import (
        SMOKE_ARGS,
        bandwidth_bound,
        build_model,
        copy_bandwidth,
        time_graph_replays,
    )

ROWS = {"default": False, "batch-invariant": True}
"""Row -> generator.batch_invariant."""


def build_engine(model_args, dtype_name: str, invariant: bool, args) -> tuple[Engine, float]:
    dtype = getattr(torch, dtype_name)
    model = build_model(model_args, torch.device("cuda"), dtype)  # seeded: the same weights
    config = EngineConfig(
        max_num_seqs=args.requests,
        max_seq_len=args.prompt_len + args.tokens,
        dtype=dtype_name,
        block_size=16,
        enable_prefix_cache=False,
        batch_invariant=invariant,
    )
    t0 = time.perf_counter()
    engine = Engine(model, config, "cuda", threaded=False, steps_per_yield=1)
    torch.cuda.synchronize()
    return engine, time.perf_counter() - t0


async def decode_pattern(engine: Engine, prompts, tokens: int, tag: str) -> dict:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *(generate(engine, p, i, tokens, tag) for i, p in enumerate(prompts))
    )
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n = sum(c.num_tokens for c in outs)
    ttft = max(c.metrics["generator/time_to_first_token_ms"] for c in outs) / 1e3
    return {
        "seconds": wall,
        "tok_per_s": n / wall,
        "decode_tok_per_s": (n - len(outs)) / max(wall - ttft, 1e-9),
        "outs": outs,
    }


async def mixed_pattern(engine: Engine, prompts, tokens: int, every: int, tag: str) -> dict:
    torch.cuda.synchronize()
    t0, steps0 = time.perf_counter(), engine.stats["steps"]
    tasks = []
    for i, p in enumerate(prompts):
        tasks.append(asyncio.ensure_future(generate(engine, p, i, tokens, tag)))
        target = engine.stats["steps"] + every
        while engine.stats["steps"] < target and not all(t.done() for t in tasks):
            await asyncio.sleep(0)  # the inline driver runs one step per pass
    outs = await asyncio.gather(*tasks)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n = sum(c.num_tokens for c in outs)
    steps = engine.stats["steps"] - steps0
    return {"seconds": wall, "tok_per_s": n / wall, "steps": steps, "ms_per_step": 1e3 * wall / steps, "outs": outs}  # fmt: skip


def generate(engine: Engine, prompt, i: int, tokens: int, tag: str):
    sampling = SamplingParams(temperature=1.0, max_tokens=tokens, seed=i)
    return engine.generate(prompt, request_id=f"{tag}{i}", sampling=sampling)


def same_bits(a: list, b: list) -> bool:
    return all(
        np.array_equal(x.token_ids_N, y.token_ids_N) and np.array_equal(x.logprobs_N, y.logprobs_N)
        for x, y in zip(a, b, strict=True)
    )


def run_cuda(args) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("--cuda needs a CUDA device")
    if args.smoke:
        model_args, dtype_name = Qwen3ModelArgs(**SMOKE_ARGS, max_seq_len=512), "float32"
    else:
        model_args, dtype_name = qwen3_args["0.6B"], "bfloat16"
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, model_args.vocab_size, (args.requests, args.prompt_len))
    prompts = list(prompts.astype(np.int32))
    engines, results = {}, {"machine": torch.cuda.get_device_name(), "torch": torch.__version__}
    results["shape"] = "tiny (smoke)" if args.smoke else "Qwen3-0.6B (random weights)"
    results.update(dtype=dtype_name, requests=args.requests, prompt_len=args.prompt_len)
    results.update(output_len=args.tokens, every=args.every, rounds=args.rounds)
    for row, invariant in ROWS.items():
        engines[row], setup_s = build_engine(model_args, dtype_name, invariant, args)
        results[row] = {"setup_s": setup_s, "decode": [], "mixed": []}
        results[row]["same_bits_in_both_patterns"] = True  # in every round
    elem = torch.finfo(getattr(torch, dtype_name)).bits // 8
    bandwidth = copy_bandwidth(torch.device("cuda"))
    model = engines["default"].runner.model
    results["bound"] = bandwidth_bound(model, model_args, _Shape(args), bandwidth, elem)

    async def rounds() -> None:
        for engine in engines.values():  # warm-up: every graph and kernel once
            await decode_pattern(engine, prompts[:4], 4, "w")
        for r in range(args.rounds):
            for row, engine in engines.items():
                decode = await decode_pattern(engine, prompts, args.tokens, f"d{r}-")
                mixed = await mixed_pattern(engine, prompts, args.tokens, args.every, f"m{r}-")
                results[row]["same_bits_in_both_patterns"] &= same_bits(
                    decode.pop("outs"), mixed.pop("outs")
                )
                results[row]["decode"].append(decode)
                results[row]["mixed"].append(mixed)
        for row, engine in engines.items():  # rewrites the graphs' inputs: last
            results[row]["decode_graph_replay_ms"] = time_graph_replays(engine.runner)
            await engine.close()

    asyncio.run(rounds())
    engines.clear()
    gc.collect()
    print_table(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_batch_invariance_cuda.json").write_text(json.dumps(results, indent=1))


class _Shape:
    """The decode pattern's shape as `bandwidth_bound` reads it."""

    def __init__(self, args) -> None:
        self.num_requests = args.requests
        self.prompt_len, self.output_len = args.prompt_len, args.tokens


def print_table(results: dict) -> None:
    def median(row: str, pattern: str, key: str) -> float:
        return statistics.median(r[key] for r in results[row][pattern])

    print(
        f"\n{results['shape']}, {results['dtype']}, {results['requests']} requests x "
        f"({results['prompt_len']} prompt + {results['output_len']} output), "
        f"{results['machine']}, median of {results['rounds']}"
    )
    print("| pattern | row | seconds | output tok/s | decode tok/s | vs default | same bits |")
    print("|---|---|---|---|---|---|---|")
    for pattern in ("decode", "mixed"):
        base = median("default", pattern, "seconds")
        name = pattern if pattern == "decode" else f"mixed (an arrival every {results['every']} steps)"  # fmt: skip
        for row in ROWS:
            seconds = median(row, pattern, "seconds")
            decode = f"{median(row, pattern, 'decode_tok_per_s'):,.0f}" if pattern == "decode" else ""  # fmt: skip
            same = "yes" if results[row]["same_bits_in_both_patterns"] else "no"
            print(
                f"| {name} | {row} | {seconds:.3f} | {median(row, pattern, 'tok_per_s'):,.0f} "
                f"| {decode} | {seconds / base:.2f}x | {same} |"
            )
    print(f"| decode | memory-bandwidth bound | | | {results['bound']['tok_per_s']:,.0f} | | |")
    for row in ROWS:
        replay = results[row]["decode_graph_replay_ms"]
        last = list(replay)[-1] if replay else "-"
        print(f"{row}: setup {results[row]['setup_s']:.1f} s, decode graph replay {last}: "
              f"{replay.get(last, float('nan')):.3f} ms")  # fmt: skip
