"""Bytes and seconds per weight sync with [lora] on: the merged full weights (what every sync
moved before adapter-only syncs, and what vLLM still gets) vs the adapters alone
(weight_sync/lora_sync.py), trainer -> one native-engine generator on CPU.

    python scripts/bench_lora_sync.py --smoke           # tiny shape, seconds
    python scripts/bench_lora_sync.py --shape 0.6B      # Qwen3-0.6B shape (vocab 151936, tied)
    python scripts/bench_lora_sync.py --shape 0.6B --transports broadcast --dtype bfloat16

In one process: the trainer's and the generator's actor code (TrainerActor, GeneratorActor
endpoints) called directly, each call in a thread of its own as in a process of its own (no
Monarch: the bytes moved and the work on either side are the same; "controller" hands the
packed buffer over in memory instead of through a message, "broadcast" is a real gloo group
over loopback). The trainer is a TrainerCore with [lora] rank --rank on all seven
projections (fp32 on CPU). A sync is what the controller awaits after every RL step: pack,
move, and on the generator unpack (full) or merge W = base + scale * B @ A (adapters), then
the engine's weight load (no requests run, so the engine loads at once: inside the time).
Between syncs every adapter changes (a step's worth). Time: median of --repeats after one
cold sync. Also: the one-time base sync an adapter-only sync needs per generator, the
generator's kept copy of the base, and the run-time alternative to merging (the extra
matmuls x A^T B^T per token, one decode step's projections of one layer, on this CPU).

Writes `bench_lora_sync.json` to --out (default: $OUT, else the current directory).
Measurements: docs/benchmarks.md ("Adapter-only weight sync").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan_rl.actors.generator import GeneratorActor
from torchtitan_rl.actors.trainer import TrainerActor
from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.models.lora import LoRAConfig, lora_modules
from torchtitan_rl.models.qwen3 import ModelConfig, build_model
from torchtitan_rl.training.trainer import TrainerCore
from torchtitan_rl.training.trainer_config import TrainingConfig
from torchtitan_rl.weight_sync.lora_sync import Payload
from torchtitan_rl.weight_sync.sides import ReceivingSide, SendingSide
from torchtitan_rl.weight_sync.transport import WeightSync

VOCAB = {"tiny": 128, "0.6B": 151936}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(VOCAB), default="tiny")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = rank: scale 1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the generator's dtype (what a full sync sends)")  # fmt: skip
    p.add_argument("--transports", nargs="+", default=["controller", "broadcast"],
                   choices=["controller", "broadcast"])  # fmt: skip
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny shape, 2 repeats")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.smoke:
        args.shape, args.repeats = "tiny", 2
    return args


class _Mesh:
    """One actor's endpoints (`call`: a mesh of one rank, `call_one`), each call run in a
    thread of its own with its own event loop, as in a process of its own."""

    def __init__(self, actor):
        self._actor = actor

    def __getattr__(self, name):
        method = type(self._actor).__dict__[name]._method
        method = getattr(method, "__wrapped__", method)
        actor = self._actor

        class _Endpoint:
            async def call_one(self, *args):
                return await asyncio.to_thread(asyncio.run, method(actor, *args))

            async def call(self, *args):
                return {0: await self.call_one(*args)}

        return _Endpoint()


def make_trainer(shape: str, rank: int) -> TrainerActor:
    actor = TrainerActor.__new__(TrainerActor)
    actor.rank = 0
    actor.core = TrainerCore(
        model_config=ModelConfig(flavor=shape, max_seq_len=64),
        training=TrainingConfig(dtype="float32"),
        loss=LossConfig(), correction=CorrectionConfig(), vocab_size=VOCAB[shape],
        device=torch.device("cpu"), seed=0, lora=LoRAConfig(rank=rank, alpha=float(rank)),
    )  # fmt: skip
    actor.sync_side = SendingSide(actor.core.device)
    return actor


def make_generator(shape: str, dtype: str) -> GeneratorActor:
    actor = GeneratorActor.__new__(GeneratorActor)
    model = build_model(
        ModelConfig(flavor=shape, max_seq_len=64), VOCAB[shape], torch.device("cpu")
    )
    actor.engine = Engine(model, EngineConfig(max_num_seqs=1, max_seq_len=64, dtype=dtype))
    actor.device = torch.device("cpu")
    actor.sync_side = ReceivingSide(actor.device)
    actor.actor_name = "generator"
    return actor


@torch.no_grad()
def step(trainer: TrainerActor, seed: int) -> None:
    """A step's worth of change to every adapter."""
    g = torch.Generator().manual_seed(seed)
    for _, m in lora_modules(trainer.core.model):
        for p in (m.lora_A, m.lora_B):
            p.add_(1e-3 * torch.randn(p.shape, generator=g))
    trainer.core.policy_version += 1


async def time_syncs(trainer, gen, transport: str, payload: Payload, args) -> dict:
    t, g = _Mesh(trainer), [_Mesh(gen)]
    t0 = time.perf_counter()
    if payload is Payload.ADAPTERS:
        sync = await WeightSync.create(t, g, args.dtype, transport)
        assert sync.payload is Payload.ADAPTERS
    else:  # what [lora] synced before: the merged full weights (vLLM still does)
        sync = WeightSync(t, g, args.dtype, transport, Payload.FULL)
        await sync.open("gloo")
    open_s = time.perf_counter() - t0
    seconds = []
    for k in range(args.repeats + 1):
        step(trainer, seed=k)
        t0 = time.perf_counter()
        await sync()
        seconds.append(time.perf_counter() - t0)
    await sync.close()
    return {
        "transport": transport, "payload": str(payload), "bytes": trainer.sync_side.last_bytes,
        "seconds": statistics.median(seconds[1:]), "cold_seconds": seconds[0],
        "open_seconds": open_s, "base_sent_to": sync.base_sent_to,
    }  # fmt: skip


def runtime_adapters(trainer: TrainerActor, rows: int = 16, repeats: int = 20) -> dict:
    """One decode step's projections of one layer on this CPU: x W^T (merged) vs
    x W^T + scale (x A^T) B^T (adapters applied at run time), `rows` tokens."""
    modules = [m for name, m in lora_modules(trainer.core.model) if name.startswith("layers.0.")]
    xs = [torch.randn(rows, m.in_features) for m in modules]

    def merged():
        return [F.linear(x, m.weight) for x, m in zip(xs, modules)]

    def runtime():
        return [
            F.linear(x, m.weight) + m.scale * F.linear(F.linear(x, m.lora_A), m.lora_B)
            for x, m in zip(xs, modules)
        ]

    times = {merged: [], runtime: []}
    with torch.no_grad():
        for _ in range(repeats):  # interleaved, the best of each: this CPU is shared
            for fn, seen in times.items():
                t0 = time.perf_counter()
                fn()
                seen.append(time.perf_counter() - t0)
    merged, runtime = (min(seen) for seen in times.values())
    return {"rows": rows, "merged_ms": 1e3 * merged, "runtime_ms": 1e3 * runtime}


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    trainer = make_trainer(args.shape, args.rank)
    rows = []
    for transport in args.transports:
        for payload in (Payload.FULL, Payload.ADAPTERS):
            gen = make_generator(args.shape, args.dtype)  # a fresh replica: the base too
            rows.append(asyncio.run(time_syncs(trainer, gen, transport, payload, args)))
            if payload is Payload.ADAPTERS:
                rows[-1]["generator_base_bytes"] = gen.sync_side.lora.nbytes()
            asyncio.run(gen.engine.close())
    runtime = runtime_adapters(trainer)

    print(f"shape {args.shape}, LoRA rank {args.rank} on all 7 projections, generator "
          f"{args.dtype}, CPU ({os.cpu_count()} cores), median of {args.repeats}")  # fmt: skip
    print("| transport | payload | MB per sync | s per sync | cold s | open s (incl. base) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['transport']} | {r['payload']} | {r['bytes'] / 1e6:,.3f} | "
              f"{r['seconds']:.4f} | {r['cold_seconds']:.4f} | {r['open_seconds']:.3f} |")  # fmt: skip
    base = next(r["generator_base_bytes"] for r in rows if "generator_base_bytes" in r)
    print(f"generator's kept base (generator_base auto, trainer dtype): {base / 1e6:,.1f} MB")
    print("| one layer's 7 projections, decode rows | merged ms | run-time adapters ms |")
    print("|---|---|---|")
    print(f"| {runtime['rows']} | {runtime['merged_ms']:.3f} | {runtime['runtime_ms']:.3f} |")
    out = Path(args.out) / "bench_lora_sync.json"
    out.write_text(json.dumps({
        "shape": args.shape, "rank": args.rank, "dtype": args.dtype, "repeats": args.repeats,
        "machine": f"{platform.node()} {platform.processor()} {os.cpu_count()} cores",
        "rows": rows, "generator_base_bytes": base, "runtime_adapters": runtime,
    }, indent=2))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
