"""The engine's two per-step kernels vs their alternatives vs the memory floor (CUDA).

    python -m scripts.bench_decode_kernels [--out DIR] [--skip-attention]
    python -m scripts.bench_decode_kernels --smoke   # CPU: the reference sampler only

1. Paged decode attention (Qwen3-0.6B shape: 16 query / 8 key-value heads, head dim 128,
   bf16 cache, block size 16) at batch 256 and 64 and several contexts, for a grid of
   launch settings (tile, splits, warps, stages) of `paged_decode_attention`, against the
   portable gather path and the floor (keys/values read once at the measured copy
   bandwidth).
2. Sampling one token per row from `[N, 151936]` fp32 logits at temperature 1: the torch
   reference (`sample_tokens` without the fused path) vs the fused kernel vs the floor
   (the logits read once).

Prints tables; writes `bench_decode_kernels.json` to `--out` (default $OUT, else .).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch

from torchtitan_rl.generation import sampling
from torchtitan_rl.generation.keyed_random import seed_keys
from torchtitan_rl.generation.model_runner import _decode_attention
from torchtitan_rl.generation.paged_attention import paged_decode_attention
from torchtitan_rl.generation.sampling_kernel import sample_full_vocab

HQ, HKV, D, BS, VOCAB = 16, 8, 128, 16, 151936


def cuda_ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_gbps() -> float:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / cuda_ms(lambda: y.copy_(x)) / 1e6


def attention_rows(gbps: float) -> list[dict]:
    shapes = [(256, 256), (256, 512), (256, 768), (256, 1024), (64, 128), (64, 256)]
    return [row for B, ctx in shapes for row in attention_shape(B, ctx, gbps)]


def attention_shape(B: int, ctx: int, gbps: float) -> list[dict]:
    rows = []
    N = ctx // BS
    num_blocks = B * N + 1
    k = torch.randn(HKV, num_blocks * BS, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(num_blocks - 1, device="cuda")[: B * N].view(B, N)
    pos = torch.full((B,), ctx - 1, device="cuda")
    floor_ms = 2 * B * ctx * HKV * D * 2 / gbps / 1e6
    ref = paged_decode_attention(q, k, v, table, pos, block_size=BS, scale=D**-0.5)
    for tile, splits, warps, stages in itertools.product(
        (32, 64, 128), (1, 2, 4), (4, 8), (2, 3, 4)
    ):
        kw = dict(tile=tile, splits=splits, num_warps=warps, num_stages=stages)

        def call(kw=kw):
            return paged_decode_attention(q, k, v, table, pos, block_size=BS, scale=D**-0.5, **kw)

        try:
            err = float((call().float() - ref.float()).abs().max())
            ms = cuda_ms(call)
        except Exception as exc:  # a setting Triton cannot compile (shared memory)
            print(f"  B={B} ctx={ctx} {kw}: {type(exc).__name__}")
            continue
        rows.append(dict(B=B, ctx=ctx, **kw, ms=ms, floor_ms=floor_ms, max_err=err))
    gather_ms = None
    if B * ctx <= 64 * 256:
        rows_idx = (table[:, :, None] * BS + torch.arange(BS, device="cuda")).flatten(1)
        key_pos = torch.arange(N * BS, device="cuda")
        hidden = (key_pos[None, :] > pos[:, None]).repeat(HKV, 1)[:, None, :]
        hidden = hidden.expand(-1, HQ // HKV, -1).contiguous()

        def gather():
            return _decode_attention(q, k[:, rows_idx], v[:, rows_idx], hidden, D**-0.5)

        gather_ms = cuda_ms(gather)
    rows.append(dict(B=B, ctx=ctx, gather_ms=gather_ms, floor_ms=floor_ms))
    return rows


def sampling_rows(gbps: float) -> list[dict]:
    return [sampling_shape(N, gbps) for N in (64, 256)]


def sampling_shape(N: int, gbps: float) -> dict:
    logits = torch.randn(N, VOCAB, device="cuda") * 4
    temp = torch.ones(N, device="cuda")
    uniform = torch.rand(N, dtype=torch.float64, device="cuda")
    keys = dict(
        key_N=seed_keys(range(N), "cuda"), position_N=torch.zeros(N, dtype=torch.long).cuda()
    )
    ones, zeros = torch.ones(N, device="cuda"), torch.zeros(N, dtype=torch.long, device="cuda")
    plan = sampling.RowPlan.of([1.0] * N, [1.0] * N, [0] * N)

    def reference():
        logprobs, _ = sampling._sampling_logprobs(
            logits, temperature_N=temp, top_p_N=ones, top_k_N=zeros, plan=plan
        )
        return sampling._inverse_cdf(logprobs, uniform), logprobs

    def fused():
        return sample_full_vocab(logits, temp, uniform)

    ref_tokens, ref_logprobs = reference()
    tokens, logprobs = fused()
    same = float((tokens == ref_tokens).float().mean())
    err = float((logprobs - ref_logprobs.gather(1, ref_tokens[:, None])[:, 0]).abs().max())
    return dict(
        N=N,
        reference_ms=cuda_ms(reference),
        fused_ms=cuda_ms(fused),
        floor_ms=N * VOCAB * 4 / gbps / 1e6,
        same_tokens=same,
        logprob_max_err=err,
        sample_tokens_ms=cuda_ms(
            lambda: sampling.sample_tokens(
                logits,
                temperature_N=temp,
                top_p_N=ones,
                top_k_N=zeros,
                **keys,
                plan=plan,
            )
        ),
    )


def smoke_on_cpu(out_dir: Path) -> None:
    """The reference sampler on a small CPU batch; the kernels' rows say they need CUDA."""
    N, V = 8, 1000
    logits = torch.randn(N, V) * 4
    ones, zeros = torch.ones(N), torch.zeros(N, dtype=torch.long)
    keys = dict(key_N=seed_keys(range(N)), position_N=torch.zeros(N, dtype=torch.long))
    start = time.perf_counter()
    out = sampling.sample_tokens(logits, temperature_N=ones, top_p_N=ones, top_k_N=zeros, **keys)
    ms = 1e3 * (time.perf_counter() - start)
    assert out.token_ids_N.shape == (N,)
    print("| rows x vocab | reference sampler ms | fused sampler | paged attention |")
    print(f"| {N} x {V} | {ms:.3f} | needs CUDA | needs CUDA |")
    (out_dir / "bench_decode_kernels.json").write_text(json.dumps(dict(cpu_reference_ms=ms)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--skip-attention", action="store_true", help="only the sampling table")
    p.add_argument(
        "--smoke", action="store_true", help="seconds: without CUDA, the reference sampler only"
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        if not args.smoke:
            p.error("the kernels need a CUDA device (--smoke runs the CPU part)")
        return smoke_on_cpu(Path(args.out))
    args.skip_attention |= args.smoke
    gbps = copy_gbps()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {gbps:.0f} GB/s")
    attention = [] if args.skip_attention else attention_rows(gbps)
    print("\npaged decode attention, best settings per shape (ms; floor = K/V read once)")
    for (B, ctx), group in itertools.groupby(attention, key=lambda r: (r["B"], r["ctx"])):
        group = list(group)
        timed = sorted((r for r in group if "ms" in r), key=lambda r: r["ms"])
        default = next(
            r
            for r in group
            if r.get("tile") == 64 and r.get("splits") == 1 and r.get("num_warps") == 4
            and r.get("num_stages") == 3
        )  # fmt: skip
        gather = next(r for r in group if "gather_ms" in r)["gather_ms"]
        print(
            f"B={B:4d} ctx={ctx:5d} floor {timed[0]['floor_ms']:.3f} | default "
            f"{default['ms']:.3f} | gather {gather if gather is None else round(gather, 3)}"
        )
        for r in timed[:5]:
            print(
                f"    {r['ms']:.3f} ms ({r['floor_ms'] / r['ms']:.0%} of floor) tile "
                f"{r['tile']} splits {r['splits']} warps {r['num_warps']} stages "
                f"{r['num_stages']} err {r['max_err']:.1e}"
            )
    print("\nsampling one token per row, V=151936, temperature 1 (ms)")
    samples = sampling_rows(gbps)
    for r in samples:
        print(
            f"N={r['N']:4d} reference {r['reference_ms']:.3f} | fused {r['fused_ms']:.3f} | "
            f"sample_tokens {r['sample_tokens_ms']:.3f} | floor {r['floor_ms']:.3f} | "
            f"same tokens {r['same_tokens']:.3f} | logprob err {r['logprob_max_err']:.1e}"
        )
    out = Path(args.out) / "bench_decode_kernels.json"
    out.write_text(json.dumps(dict(copy_gbps=gbps, attention=attention, sampling=samples)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
