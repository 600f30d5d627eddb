"""vLLM with [lora]: each version as a LoRA adapter (lora.vllm_sync = "adapters") vs the merged
full weights reloaded in place ("merged"): bytes and seconds per weight sync, and decode
tokens/s on the same requests.

    python scripts/bench_vllm_lora.py --smoke                  # tiny shape, seconds
    python scripts/bench_vllm_lora.py                          # tiny shape
    python scripts/bench_vllm_lora.py --shape 0.6B --repeats 3 # Qwen3-0.6B shape, random init
    python scripts/bench_vllm_lora.py --shape 8B --device cuda --dtype bfloat16   # a GPU

In one process, each engine the generator's own (`build_engine` with [lora]), started from
a random-init Qwen3 of the shape exported as a Hugging Face folder; rank --rank adapters
(alpha = rank) on all seven projections, B random (a trained version's adapters, not the
zero of step 0).
- sync: what the generator's engine does with one new version. merged: reload the merged
  full weights in place (tensors on the engine's device, as the CUDA IPC transport hands
  them over) and reset the prefix cache; adapters: write the PEFT folder, register it with
  vLLM (`add_lora`) and remove the previous one. Seconds: the engine's pull
  (`EngineFront.loop_seconds["pull_s"]`), median of --repeats after the first load (which
  for "adapters" also reloads the base, once per generator). Bytes: what the sync moves
  from the trainer (merged: every weight in the generator's dtype; adapters: A and B in
  fp32 and the scale) and, for adapters, the folder written.
- decode: --requests requests of --prompt-len random tokens, all submitted at once, each
  generating exactly --new-tokens (temperature 1, a seed each, no stop); output tokens per
  wall second, median (and best) of --repeats rounds after a warm one; the same requests
  on both engines (on CPU both up, their rounds alternating; on a GPU one after the other).

Writes `bench_vllm_lora.json` to --out (default: $OUT, else the current directory).
Measurements: docs/benchmarks.md ("vLLM with [lora]").
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from torchtitan_rl.device import DTYPES
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.models.hf_export import export_hf
from torchtitan_rl.models.lora import TARGETS, LoRAConfig
from torchtitan_rl.models.qwen3 import ModelConfig, build_model
from torchtitan_rl.types import SamplingParams
from torchtitan_rl.weight_sync.lora_sync import SCALE

VOCAB = {"tiny": 896, "0.6B": 151936, "4B": 151936, "8B": 151936}
MODES = ("merged", "adapters")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(VOCAB), default="tiny")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = rank: scale 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="tiny shape, 2 repeats, 8 tokens")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.smoke:
        args.shape, args.repeats, args.requests, args.new_tokens = "tiny", 2, 4, 8
        args.device, args.dtype = "cpu", "float32"
    return args


def vllm_missing() -> bool:
    """True (and says so) when vLLM is not installed: every row needs it."""
    if importlib.util.find_spec("vllm") is None:
        print("| vllm is not installed: no rows (pip install the vllm extra, README) |")
        return True
    import vllm

    print(f"vLLM {vllm.__version__}")
    return False


@torch.no_grad()
def versions(base: dict[str, torch.Tensor], count: int, rank: int) -> list[dict]:
    """`count` versions' adapters (torchtitan names, fp32, and the scale), B random."""
    out = []
    for v in range(count):
        g = torch.Generator().manual_seed(v)
        state = {}
        for name, w in base.items():
            if any(name.endswith(f"{tt}.weight") for tt, _ in TARGETS.values()):
                prefix = name.removesuffix(".weight")
                a = torch.randn(rank, w.shape[1], generator=g) / w.shape[1] ** 0.5
                state[f"{prefix}.lora_A"] = a
                state[f"{prefix}.lora_B"] = 0.01 * torch.randn(w.shape[0], rank, generator=g)
        state[SCALE] = torch.tensor(1.0)
        out.append(state)
    return out


@torch.no_grad()
def merged(base: dict, adapters: dict, dtype: torch.dtype, device) -> dict:
    """W + scale * B @ A in fp32, then the generator's dtype, on its device (a FULL sync)."""
    scale = float(adapters[SCALE])
    out = {}
    for name, w in base.items():
        prefix = name.removesuffix(".weight")
        w = w.to(device)
        if f"{prefix}.lora_A" in adapters:
            a, b = (adapters[f"{prefix}.lora_{x}"].to(device) for x in "AB")
            w = w.float() + scale * (b @ a)
        out[name] = w.to(dtype)
    return out


async def pull(engine, state, version: int, partial: bool) -> float:
    """Seconds of the engine's pull of one load (between its steps, as in a run)."""
    before, t0 = engine.loop_seconds["pull_s"], time.perf_counter()
    engine.load_weights(state, version, partial=partial)  # pulls now while nothing runs yet
    now_s = time.perf_counter() - t0
    ping = SamplingParams(temperature=0.0, max_tokens=1)  # starts the driver if idle
    await engine.generate(np.array([1, 2, 3], np.int32), request_id=f"p{version}", sampling=ping)
    assert engine.policy_version == version
    return now_s + engine.loop_seconds["pull_s"] - before


async def decode(engine, prompts: list[np.ndarray], new_tokens: int, tag: str) -> float:
    """Output tokens per second of every prompt at once (exactly `new_tokens` each)."""
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(
        engine.generate(p, request_id=f"{tag}{i}", sampling=SamplingParams(
            temperature=1.0, max_tokens=new_tokens, seed=i))
        for i, p in enumerate(prompts)
    ))  # fmt: skip
    seconds = time.perf_counter() - t0
    assert all(o.num_tokens == new_tokens for o in outs), [o.error for o in outs]
    return sum(o.num_tokens for o in outs) / seconds


def start(mode: str, args, model_config, folder: str):
    from torchtitan_rl.actors.generator import build_engine

    config = EngineConfig(
        backend="vllm", max_num_seqs=max(args.requests, 4), dtype=args.dtype,
        max_seq_len=args.prompt_len + args.new_tokens + 8,
        block_size=32 if args.device == "cpu" else 16,
    )  # fmt: skip
    lora = LoRAConfig(rank=args.rank, alpha=float(args.rank), vllm_sync=mode)
    return build_engine(
        model_config, config, VOCAB[args.shape], torch.device(args.device), folder, lora
    )


async def syncs(mode: str, engine, args, base: dict, all_versions) -> dict:
    """Every version to `engine` as its mode takes it; seconds and bytes per sync."""
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    seconds, written = [], 0
    for v, adapters in enumerate(all_versions, start=1):
        if mode == "merged":
            state, partial = merged(base, adapters, dtype, device), False
        else:
            state, partial = ({**base, **adapters} if v == 1 else adapters), v > 1
        seconds.append(await pull(engine, state, v, partial))
        if mode == "adapters":
            written = engine._adapters.last_load["bytes"]
        del state
    if mode == "merged":
        unique = {w.data_ptr(): w.numel() for w in base.values()}  # a tied head once
        sync_bytes = sum(unique.values()) * dtype.itemsize
    else:  # what lora_sync.adapter_payload packs: fp32 A and B, and the 4-byte scale
        sync_bytes = 4 * sum(t.numel() for t in all_versions[-1].values())
    return {"mode": mode, "sync_bytes": sync_bytes, "folder_bytes": written,
            "first_s": seconds[0], "sync_s": statistics.median(seconds[1:])}  # fmt: skip


def run(args, model_config, folder: str, base: dict, all_versions) -> list[dict]:
    """The syncs of each engine, then decode rounds. On CPU both engines are up side by side
    and their rounds alternate (this VM's load changes by the minute: interleaved rounds see
    the same); on a GPU one engine at a time (each takes its own share of GPU memory)."""
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(1, VOCAB[args.shape], args.prompt_len).astype(np.int32)
        for _ in range(args.requests)
    ]
    groups = [MODES] if args.device == "cpu" else [(m,) for m in MODES]

    async def go(modes) -> list[dict]:
        engines = {m: start(m, args, model_config, folder) for m in modes}
        rows = [await syncs(m, e, args, base, all_versions) for m, e in engines.items()]
        rates = {m: [] for m in modes}
        for k in range(args.repeats + 1):  # the first round warms up
            for mode, engine in engines.items():
                rates[mode].append(await decode(engine, prompts, args.new_tokens, f"r{k}"))
        for row in rows:
            row["tok_per_s"] = statistics.median(rates[row["mode"]][1:])
            row["tok_per_s_best"] = max(rates[row["mode"]][1:])
        for engine in engines.values():
            await engine.close()
        return rows

    return [row for modes in groups for row in asyncio.run(go(modes))]


def main() -> None:
    args = parse_args()
    print(f"shape {args.shape}, LoRA rank {args.rank} on all 7 projections, vLLM "
          f"{args.dtype} on {args.device} ({os.cpu_count()} CPU cores), median of "
          f"{args.repeats}")  # fmt: skip
    rows = []
    if not vllm_missing():
        torch.manual_seed(0)
        model_config = ModelConfig(flavor=args.shape, max_seq_len=1024)
        model = build_model(model_config, VOCAB[args.shape], torch.device("cpu"))
        base = {k: v.detach() for k, v in model.state_dict().items()}
        all_versions = versions(base, args.repeats + 1, args.rank)
        with tempfile.TemporaryDirectory() as tmp:
            folder = str(export_hf(base, model.model_args, Path(tmp) / "hf", dtype=args.dtype))
            del model
            rows = run(args, model_config, folder, base, all_versions)
    print("| vLLM takes | MB per sync | folder MB | s per sync | first sync s | decode tok/s "
          "(median, best) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['sync_bytes'] / 1e6:,.3f} | {r['folder_bytes'] / 1e6:,.3f} | "
              f"{r['sync_s']:.4f} | {r['first_s']:.3f} | {r['tok_per_s']:,.1f}, "
              f"{r['tok_per_s_best']:,.1f} |")  # fmt: skip
    out = Path(args.out) / "bench_vllm_lora.json"
    out.write_text(json.dumps({
        "shape": args.shape, "rank": args.rank, "device": args.device, "dtype": args.dtype,
        "repeats": args.repeats, "requests": args.requests, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "rows": rows,
        "machine": f"{platform.node()} {platform.processor()} {os.cpu_count()} cores",
    }, indent=2))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
