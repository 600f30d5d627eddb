"""Benchmark: the trainer's first step and steady steps, FlexAttention compiled by Inductor's
defaults (ours, `models.qwen3.FlexAttention`) vs torchtitan's max-autotune
(`FlexAttentionWrapper`), each case in a fresh process with empty compile caches.

    python scripts/bench_flex_compile.py           # H200: the 0.6B shape (8 x 2048 tokens,
        # 8 documents a row), with and without training.compile, and the tiny shape without
    python scripts/bench_flex_compile.py --smoke   # CPU, tiny, one case: the script runs

A case builds the model (bf16 parameters, fused AdamW, as bench_train.py), then times its
first step (forward + backward + AdamW: compiling, and autotuning for torchtitan's), its first
no-grad forward (the trainer's log-prob recompute: another graph), and the median of 10
steady steps and 5 no-grad forwards. The floor of a first step is a steady one (nothing left
to compile). On CPU the model runs dense masked SDPA (FlexAttention has no CPU backward), so
the smoke times that path only. Writes JSON to --out (default $OUT/bench_flex_compile.json,
else outputs/bench_flex_compile.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from json_out import write_json

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    *[("0.6B", compile_, flex) for compile_ in (True, False) for flex in ("ours", "torchtitan")],
    ("tiny", False, "ours"),
    ("tiny", False, "torchtitan"),
]
"""(flavor, training.compile, whose FlexAttention)."""
SHAPES = {"0.6B": (8, 2048, 8, 151936), "tiny": (8, 256, 2, 1024)}
"""flavor -> rows, sequence length, documents a row, vocabulary (the jobs' batcher rows)."""


def _timed(fn, device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_case(flavor: str, compile_: bool, flex: str, smoke: bool) -> dict:
    """One case, in this process (a fresh one: `main` starts it)."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_train import _step, make_batch
    from torchtitan.models.attention import FlexAttentionWrapper

    from torchtitan_rl.models.qwen3 import FlexAttention, ModelConfig, build_model
    from torchtitan_rl.training.parallelize import apply_compile

    device = torch.device("cpu" if smoke else "cuda")
    rows, seq, docs, vocab = (2, 64, 2, 1024) if smoke else SHAPES[flavor]
    torch.manual_seed(0)
    model = build_model(ModelConfig(flavor=flavor, max_seq_len=seq), vocab, device)
    if flex == "torchtitan" and device.type == "cuda":
        for layer in model.layers.values():
            layer.attention.inner_attention = FlexAttentionWrapper()
    assert device.type == "cpu" or isinstance(
        model.layers["0"].attention.inner_attention, FlexAttention
    ) == (flex == "ours")
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    if compile_:
        apply_compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    batch = make_batch(rows, seq, docs, vocab, device)

    def step():
        _step(model, optimizer, batch)

    @torch.no_grad()
    def forward():
        model(*batch[:3], batch[3], batch[4], 1.0, None)

    first_step, first_forward = _timed(step, device), _timed(forward, device)
    for _ in range(2):
        step()
    steps = [_timed(step, device) for _ in range(2 if smoke else 10)]
    forwards = [_timed(forward, device) for _ in range(2 if smoke else 5)]
    return dict(
        flavor=flavor, compile=compile_, flex=flex, tokens=rows * seq,
        first_step_s=first_step, first_forward_s=first_forward,
        step_ms=statistics.median(steps) * 1e3, forward_ms=statistics.median(forwards) * 1e3,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--case", nargs=3, help=argparse.SUPPRESS)  # a child: flavor compile flex
    args = p.parse_args()
    if args.case:
        flavor, compile_, flex = args.case
        print("RESULT " + json.dumps(run_case(flavor, compile_ == "1", flex, args.smoke)))
        return
    rows = []
    for flavor, compile_, flex in [("tiny", False, "ours")] if args.smoke else CASES:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
                   "TRITON_CACHE_DIR": f"{cache}/triton"}  # fmt: skip
            cmd = [sys.executable, __file__, "--case", flavor, str(int(compile_)), flex]
            start = time.perf_counter()
            run = subprocess.run(cmd + ["--smoke"] * args.smoke, env=env, capture_output=True,
                                 text=True, timeout=600)  # fmt: skip
        result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        if run.returncode or not result:
            print(f"{flavor} compile={compile_} {flex}: failed\n{run.stderr[-3000:]}")
            continue
        rows.append({**json.loads(result[0][7:]), "process_s": time.perf_counter() - start})
    device = "CPU (dense SDPA)" if args.smoke else "CUDA"
    print(f"\n{device}; bf16; each case a fresh process with empty Inductor and Triton caches")
    print(
        "| flavor | training.compile | FlexAttention | first step s | first no-grad forward s "
        "| steady step ms | no-grad forward ms | process s |\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(f"| {r['flavor']} | {str(r['compile']).lower()} | {r['flex']} | "
              f"{r['first_step_s']:.1f} | {r['first_forward_s']:.1f} | {r['step_ms']:.1f} | "
              f"{r['forward_ms']:.1f} | {r['process_s']:.0f} |")  # fmt: skip
    write_json(args.out, "bench_flex_compile.json", dict(device=device, rows=rows))
    if len(rows) < (1 if args.smoke else len(CASES)):
        sys.exit(1)


if __name__ == "__main__":
    main()
