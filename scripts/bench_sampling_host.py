"""Benchmark: host time the native engine spends per step around its sampler.

    python scripts/bench_sampling_host.py            # 256 rows, 300 steps (CUDA if present)
    python scripts/bench_sampling_host.py --smoke    # 16 rows, 20 steps, CPU
    python scripts/bench_sampling_host.py --device cpu --rows 64   # `_record` on the host

Milliseconds of host time per step in `Engine._launch_sample` (the rows' settings and
random draws, queueing the sampler and the copies of its results to the host) and
`Engine._record` (reading the tokens, appending them, the finish checks), for one running
batch of seeded requests that never finishes, fed the same random logits every step (no
forward runs); `rows changed`: `_launch_sample` when the batch differs from the last
step's (here: the same rows in another order), which updates the rows' settings by what
changed (here every row moves). Two settings: temperature 1 over the full vocabulary (the
RL default; on CUDA the fused sampling kernel) and top-p 0.9 (the masked reference path).
`ops`: tensor ops per step (each a kernel launch or a copy on CUDA; views left out, and
the fused sampler's four Triton launches are not tensor ops), counted under a
`TorchDispatchMode` in `_launch_sample` with the rows the same and changed, and in the
sampler's math (which leaves out the gather of the sampled tokens' log-probs: one op).

On CUDA the device is synchronized before `_record`, so its wait for the sampler is left
out: every column is host time. On CPU `_launch_sample` also computes the sampler;
`sampler math` is that computation alone (log-softmax and inverse CDF from given
uniforms), so `launch - math` is the bookkeeping (on CUDA `sampler math` is the host time
to queue the reference math, not the fused kernel `_launch_sample` takes at temperature
1). The floor of the bookkeeping is 0: the same work could be a captured graph. Writes
JSON to --out ($OUT, else .).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_rl.generation import sampling
from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.models.qwen3 import ModelConfig, build_model
from torchtitan_rl.types import SamplingParams

STOP_TOKEN_IDS = (-1, -2)
"""Two ids no row samples: every row checks its token against them at every step, as the
RL job's requests check the chat template's end ids, and no row finishes."""
SETTINGS = {
    "temperature 1": SamplingParams(temperature=1.0),
    "top-p 0.9": SamplingParams(top_p=0.9),
}


def engine_with_rows(loop, rows: int, steps: int, sampling: SamplingParams, device) -> tuple:
    """An engine whose running batch holds `rows` seeded requests that outlast `steps`
    steps (their futures on `loop`), and those requests."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(), 97, device)
    config = EngineConfig(max_num_seqs=rows, max_seq_len=2 * steps + 48, cuda_graphs=False)
    engine = Engine(model, config, device, threaded=False)
    for i in range(rows):
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=2 * steps + 40,
            stop_token_ids=STOP_TOKEN_IDS,
            seed=i,
        )
        engine._enqueue(str(i), [1 + i % 50, 2, 3], params, loop.create_future(), 0.0)
    engine._admit()
    requests = list(engine._sched.running)
    assert len(requests) == rows
    return engine, requests


def timed_steps(
    engine: Engine, requests: list, logits_NV: torch.Tensor, steps: int, changing: bool = False
) -> dict:
    """Median host ms per step; `changing`: the rows come in another order every step, so
    every step rebuilds the rows' settings (as when requests join or finish)."""
    cuda = logits_NV.device.type == "cuda"
    launch, record = [], []
    for step in range(steps):
        rows = requests[::-1] if changing and step % 2 else list(requests)
        t0 = time.perf_counter()
        sampled = engine._launch_sample(rows, logits_NV)
        t1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        engine._record(rows, sampled, 0)
        t3 = time.perf_counter()
        launch.append(t1 - t0)
        record.append(t3 - t2)
    skip = min(5, steps // 4)  # warm-up: first build of the rows' settings, allocator
    return dict(
        launch_ms=1e3 * statistics.median(launch[skip:]),
        record_ms=1e3 * statistics.median(record[skip:]),
    )


def math_ms(logits_NV: torch.Tensor, sampling_params: SamplingParams, steps: int) -> float:
    """The sampler's computation from given uniforms, as `_launch_sample` queues it."""
    times = []
    for _ in range(steps):
        math = sampler_math(logits_NV, sampling_params)
        if logits_NV.device.type == "cuda":
            torch.cuda.synchronize()  # an empty queue, as at every step of `timed_steps`
        t0 = time.perf_counter()
        math()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[min(5, steps // 4) :])


def sampler_math(logits_NV: torch.Tensor, sampling_params: SamplingParams):
    """A call of the sampler's log-softmax and inverse CDF over rows of one setting."""
    N = logits_NV.shape[0]
    device = logits_NV.device
    temp = torch.full((N,), sampling_params.temperature, device=device)
    top_p = torch.full((N,), sampling_params.top_p, device=device)
    top_k = torch.zeros(N, dtype=torch.long, device=device)
    uniform = torch.rand(N, dtype=torch.float64, device=device)
    plan = sampling.RowPlan.of(
        [sampling_params.temperature] * N, [sampling_params.top_p] * N, [0] * N
    )

    def math():
        logprobs, _ = sampling._sampling_logprobs(
            logits_NV, temperature_N=temp, top_p_N=top_p, top_k_N=top_k, plan=plan
        )
        sampling._inverse_cdf(logprobs, uniform)

    return math


class CountOps(TorchDispatchMode):
    """Counts the tensor ops run under it, views left out (they launch nothing). On CUDA a
    Triton kernel launch is not a tensor op: the fused sampler's four are not counted."""

    VIEWS = {"aten.slice.Tensor", "aten.view.dtype", "aten.alias.default", "aten.view.default",
             "aten.unsqueeze.default", "aten.squeeze.dim", "aten.select.int"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += str(func) not in self.VIEWS
        return func(*args, **(kwargs or {}))


def ops_per_step(engine: Engine, requests: list, logits_NV: torch.Tensor, changing: bool) -> int:
    """Tensor ops in `_launch_sample` at the last of a few steps (`timed_steps`' rows)."""
    for step in range(4):
        rows = requests[::-1] if changing and step % 2 else list(requests)
        with CountOps() as counted:
            sampled = engine._launch_sample(rows, logits_NV)
        engine._record(rows, sampled, 0)
    return counted.ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--vocab", type=int, default=0, help="0: 151936 on CUDA, 128 on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--smoke", action="store_true", help="16 rows, 20 steps, CPU")
    args = p.parse_args()
    if args.smoke:
        args.rows, args.steps, args.device = 16, 20, "cpu"
    device = torch.device(args.device)
    vocab = args.vocab or (151936 if device.type == "cuda" else 128)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the engine's host work is one thread
    results = []
    for name, setting in SETTINGS.items():
        loop = asyncio.new_event_loop()
        engine, requests = engine_with_rows(loop, args.rows, args.steps, setting, device)
        logits_NV = torch.randn(args.rows, vocab, device=device) * 4
        row = dict(setting=name, rows=args.rows, vocab=vocab, device=str(device))
        row |= timed_steps(engine, requests, logits_NV, args.steps)
        changed = timed_steps(engine, requests, logits_NV, args.steps, changing=True)
        row["launch_rows_changed_ms"] = changed["launch_ms"]
        assert all(len(r.token_ids) == 2 * args.steps for r in requests)
        row["math_ms"] = math_ms(logits_NV, setting, args.steps)
        row["launch_ops"] = ops_per_step(engine, requests, logits_NV, changing=False)
        row["launch_rows_changed_ops"] = ops_per_step(engine, requests, logits_NV, changing=True)
        math = sampler_math(logits_NV, setting)
        with CountOps() as counted:
            math()
        row["math_ops"] = counted.ops
        results.append(row)
        loop.close()
    print(f"host ms per step, {args.rows} rows, vocab {vocab}, {device}; tensor ops per step")
    print("| setting | launch_sample | record | launch + record | sampler math "
          "| launch_sample, rows changed | ops: launch / rows changed / math |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in results:
        total = r["launch_ms"] + r["record_ms"]
        ops = f"{r['launch_ops']} / {r['launch_rows_changed_ops']} / {r['math_ops']}"
        print(
            f"| {r['setting']} | {r['launch_ms']:.3f} | {r['record_ms']:.3f} | {total:.3f} "
            f"| {r['math_ms']:.3f} | {r['launch_rows_changed_ms']:.3f} | {ops} |"
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / "bench_sampling_host.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
