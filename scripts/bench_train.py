"""Benchmark: training throughput of the policy model, our log-prob head vs the naive one.

    python scripts/bench_train.py            # H200: Qwen3-0.6B shape, bf16, 4 x 4096 tokens
    python scripts/bench_train.py --profile  # and each row's top kernels by device time
    python scripts/bench_train.py --smoke    # tiny model on CPU, eager rows only, seconds

One step = forward (log-prob + entropy of every token) + backward + AdamW, called the way
TrainerCore calls the model (tokens, positions, document ids, loss positions, targets).
Rows: eager, then compiled (`training.compile`: each block through torch.compile, as
TrainerCore does), each with our head and the naive one.
Parameters are bf16 (buffers such as the RoPE cache stay fp32), as FSDP's bf16 mixed
precision computes; AdamW runs fused on the bf16 parameters. Each row of the batch packs
--docs documents of equal length; every token is a loss token.
MFU = model FLOPs / step time / peak, with model FLOPs per token = 6 * (matmul parameters)
+ 6 * D * V (LM head) + 12 * layers * heads * head_dim * (mean attended keys); our head
actually runs 8 * D * V (logits recomputed in the backward) and attention skips masked
blocks, neither of which is counted. Peak: 989 TFLOP/s (H200 dense bf16, datasheet).
Writes JSON to --out (default $OUT/bench_train.json, else outputs/bench_train.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan_rl.models.qwen3 import ModelConfig, build_model
from torchtitan_rl.training.parallelize import apply_compile

PEAK_BF16_TFLOPS = 989.0
"""H200 SXM dense bf16 tensor-core peak (datasheet); MFU is relative to this."""


def naive_head_forward(self, hidden_ND, targets_N=None, temperature: float = 1.0, support=None):
    """The head as it is usually written: full fp32 [N, V] log-softmax, then gather."""
    logp_NV = torch.log_softmax(F.linear(hidden_ND, self.weight).float() / temperature, dim=-1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return logp_NV.gather(1, targets_N[:, None]).squeeze(1), entropy_N


def make_batch(rows, seq, docs, vocab, device):
    gen = torch.Generator().manual_seed(0)
    doc_len = seq // docs
    tokens = torch.randint(0, vocab, (rows, seq), generator=gen)
    positions = torch.arange(seq) % doc_len
    document_ids = torch.arange(seq) // doc_len
    loss_index = torch.arange(rows * seq)
    targets = torch.randint(0, vocab, (rows * seq,), generator=gen)
    batch = (
        tokens,
        positions.expand(rows, seq),
        document_ids.expand(rows, seq),
        loss_index,
        targets,
    )
    return [t.contiguous().to(device) for t in batch]


def model_flops_per_token(model, seq, docs) -> float:
    args = model.model_args
    head = args.vocab_size * args.dim
    matmul_params = sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "layers." in name
    )
    mean_keys = (seq // docs + 1) / 2
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * mean_keys
    return 6 * matmul_params + 6 * head + attention


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step(model, optimizer, batch):
    optimizer.zero_grad(set_to_none=True)
    logprobs_N, entropy_N = model(*batch[:3], batch[3], batch[4], 1.0, None)
    loss = -logprobs_N.mean() - 0.01 * entropy_N.mean()
    loss.backward()
    optimizer.step()


def time_steps(model, optimizer, batch, device, warmup, steps):
    for _ in range(warmup):
        _step(model, optimizer, batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        _step(model, optimizer, batch)
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak


def profile_step(model, optimizer, batch, name: str, top: int = 15) -> None:
    """Profile one step; print its `top` operations and kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(model, optimizer, batch)
        torch.cuda.synchronize()
    events = prof.key_averages()
    total_ms = sum(e.self_device_time_total for e in events) / 1e3
    print(f"\n[{name}] device busy {total_ms:.1f} ms; top {top} by self device time:")
    for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--flavor", default="0.6B")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--docs", type=int, default=2, help="documents packed per row")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default="", choices=["", "eager", "compiled", "eager,compiled"],
                   help="rows to run; default eager,compiled (eager with --smoke)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="print each row's top kernels")
    p.add_argument("--out", default="")
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        args.flavor, args.rows, args.seq, args.vocab, args.steps, args.warmup = (
            "tiny", 2, 64, 1024, 2, 1,
        )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(ModelConfig(flavor=args.flavor, max_seq_len=args.seq), args.vocab, device)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    batch = make_batch(args.rows, args.seq, args.docs, args.vocab, device)
    tokens = args.rows * args.seq
    flops = model_flops_per_token(model, args.seq, args.docs) * tokens
    rows = []
    for mode in (args.modes or ("eager" if args.smoke else "eager,compiled")).split(","):
        if mode == "compiled":
            apply_compile(model)
        for head in ("ours", "naive"):
            if head == "naive":
                model.output.forward = types.MethodType(naive_head_forward, model.output)
            seconds, peak = time_steps(model, optimizer, batch, device, args.warmup, args.steps)
            if args.profile:
                profile_step(model, optimizer, batch, f"{mode}-{head}")
            vars(model.output).pop("forward", None)  # back to LogProbHead.forward
            tflops = flops / seconds / 1e12
            rows.append(
                dict(mode=mode, head=head, step_ms=seconds * 1e3, tokens_per_s=tokens / seconds,
                     model_tflops=tflops, mfu=tflops / PEAK_BF16_TFLOPS, peak_gib=peak)
            )  # fmt: skip
    print(f"\n{_device_name(device)}; flavor {args.flavor}, {args.rows} x {args.seq} tokens, "
          f"{args.docs} docs/row, bf16; median of {args.steps} steps")  # fmt: skip
    print(
        "| blocks | head | step ms | tokens/s | model TFLOP/s | MFU | peak GiB |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in rows:
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(f"| {r['mode']} | {r['head']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['model_tflops']:.1f} | {r['mfu']:.1%} | {peak} |")  # fmt: skip
    out = Path(args.out or Path(os.environ.get("OUT", "outputs")) / "bench_train.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(dict(device=_device_name(device), args=vars(args), rows=rows), indent=2)
    )
    print(f"wrote {out}")


def _device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
