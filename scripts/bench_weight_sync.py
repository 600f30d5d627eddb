"""Seconds and bytes per weight sync, trainer -> generator in separate Monarch processes:
CUDA IPC vs the broadcast group sending the whole buffer ("full": NCCL on GPUs, plus a gloo
row through CPU buffers; gloo on CPU) vs the delta transport in the same group (after each
simulated RL step changed --changed of the weights) vs the packed buffer through the
controller vs the copy floor; with --hosts, on two simulated hosts (ProcessJob), plus
Monarch's RDMABuffer (TCP fallback).

    python scripts/bench_weight_sync.py            # GPU: Qwen3-0.6B shape (vocab 151936, tied), bf16
    python scripts/bench_weight_sync.py --smoke    # tiny model on CPU, seconds
    python scripts/bench_weight_sync.py --hosts --dtype bfloat16   # CPU, trainer and generator
                                                   # on two hosts of a ProcessJob, 0.6B shape
    python scripts/bench_weight_sync.py --transports full delta --device cuda --generator-gpu 1
                                                   # full vs delta, NCCL and gloo, 2 GPUs

One trainer process (TrainerActor: FSDP on one rank, fp32 master weights, as in a run) and one
generator process (GeneratorActor with a small engine), both on the same GPU. A sync is what
the controller awaits after every RL step (`WeightSync`): the trainer gathers its weights in
the generator dtype, the generator holds its own copy and applies it (with no requests
running, the engine applies new weights at once, so that copy is inside the time). Time:
median of --repeats syncs after one cold sync (the cold one allocates and opens buffers).
"trainer side" is the trainer call alone (gather + pack, and for the controller path the
transfer of the buffer to the controller).

The floor: a sync must at least read the weights once and write them once; that is the
time of one device-to-device copy of the buffer, measured here (on CPU: one memory copy).
The RDMABuffer row (--hosts) times the transfer alone: a buffer of the same bytes, registered
on the trainer's host and pulled by the generator's host with `read_into` (no packing, no
engine apply), so it is a lower bound for a sync built on it.
Writes `bench_weight_sync.json` to --out (default: $OUT, else the current directory).

Measurements (H200, 2 x H100, two simulated hosts on the 2-core VM, full vs delta):
docs/benchmarks.md ("Weight sync", "Delta weight sync") and docs/hosts.md ("Measured here").
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from monarch.actor import Actor, endpoint, this_host
from monarch.spmd import setup_torch_elastic_env_async

from torchtitan_rl.actors.generator import GeneratorActor
from torchtitan_rl.actors.trainer import TrainerActor
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.models.qwen3 import ModelConfig
from torchtitan_rl.train import leave
from torchtitan_rl.training.trainer_config import TrainingConfig
from torchtitan_rl.weight_sync.strategies import TRANSPORTS
from torchtitan_rl.weight_sync.transport import WeightSync, broadcast_backend, choose_transport

QWEN3_VOCAB = 151936


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    p.add_argument(
        "--hosts", action="store_true",
        help="trainer and generator on two simulated hosts (ProcessJob), CPU; adds RDMABuffer",
    )  # fmt: skip
    p.add_argument(
        "--transports", nargs="+", default=["cuda_ipc", "full", "delta", "controller", "rdma"],
        help="rows to time, space or comma separated: cuda_ipc (where it applies), full (the "
        "whole-buffer broadcast; also 'broadcast'), delta, controller, rdma (only with "
        "--hosts); the controller row needs ~4 extra copies of the weights in memory",
    )  # fmt: skip
    p.add_argument(
        "--changed", default="0.169,0.079",
        help="fractions of the weights each simulated RL step changes before a delta sync "
        "(the range measured at the 0.6B shape, scripts/measure_weight_delta.py)",
    )  # fmt: skip
    p.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"),
        help="auto: CUDA when present (CPU with --smoke)",
    )  # fmt: skip
    p.add_argument(
        "--out", default=os.environ.get("OUT", "."),
        help="folder for bench_weight_sync.json, or a path ending in .json",
    )  # fmt: skip
    p.add_argument("--flavor", default="0.6B")
    p.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--generator-gpu", type=int, default=0,
        help="GPU of the generator process (the trainer is on GPU 0): 1 = across two GPUs",
    )  # fmt: skip
    args = p.parse_args()
    args.transports = [
        {"broadcast": "full"}.get(t, t) for arg in args.transports for t in arg.split(",") if t
    ]
    args.changed = [float(f) for f in args.changed.split(",")]
    if args.smoke:
        args.flavor, args.vocab, args.repeats = "tiny", 96, 2
        args.dtype = "float32" if args.dtype == "bfloat16" else args.dtype
    return args


def copy_seconds(
    nbytes: int, device: torch.device, repeats: int = 5, to: torch.device | None = None
) -> float:
    """Median time of one copy of `nbytes` bytes from `device` to `to` (default: itself)."""
    to = to or device
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=to)
    times = []
    for _ in range(repeats + 1):
        _sync(device), _sync(to)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device), _sync(to)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def time_calls(fn, repeats: int) -> dict[str, float]:
    cold = await _timed(fn)
    warm = [await _timed(fn) for _ in range(repeats)]
    return {"cold_s": cold, "median_s": statistics.median(warm), "min_s": min(warm)}


async def _timed(fn) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


class BenchTrainer(TrainerActor):
    """The trainer actor plus what the benchmark needs: an RL step's worth of changed
    weights, and what the last send put on the wire."""

    @endpoint
    async def perturb(self, fraction: float, seed: int) -> None:
        """Move about `fraction` of every weight by 3% (enough to change its bf16 value)."""
        g = torch.Generator(device=self.core.device).manual_seed(seed)
        with torch.no_grad():
            for p in self.core.model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                mask = torch.rand(local.shape, generator=g, device=local.device) < fraction
                local.mul_(torch.where(mask, 1.03, 1.0))
        self.core.policy_version += 1

    @endpoint
    async def last_send(self) -> dict | None:
        """The delta sender's {"mode", "changed", "bytes"} of its last send (None else)."""
        return getattr(self.sync_side.sender, "last", None) if self.rank == 0 else None


class RdmaSource(Actor):
    """A buffer of `nbytes` registered for RDMA on the trainer's host."""

    def __init__(self, nbytes: int):
        self.buf = torch.ones(nbytes, dtype=torch.uint8)

    @endpoint
    async def handle(self):
        from monarch.rdma import RDMABuffer

        return RDMABuffer(self.buf)


class RdmaSink(Actor):
    """Pulls the source's buffer into one of its own (the generator's host)."""

    def __init__(self, nbytes: int):
        self.buf = torch.empty(nbytes, dtype=torch.uint8)

    @endpoint
    async def read(self, handle) -> int:
        await handle.read_into(self.buf)
        return int(self.buf[-1])


async def spawn_procs(args, device: str):
    """(trainer procs, generator procs, job): on this host, or with --hosts on the hosts
    "trainer_0" and "generator_0" of a ProcessJob (each a local subprocess)."""
    kind = "gpus" if device == "cuda" else "procs"
    if not args.hosts:
        host = this_host()
        return host.spawn_procs(per_host={kind: 1}), host.spawn_procs(per_host={kind: 1}), None
    from monarch._src.job.process import ProcessJob

    job = ProcessJob({"trainer": 1, "generator": 1})
    state = job.state(cached_path=None)
    trainer = state.trainer.spawn_procs(per_host={kind: 1})
    return trainer, state.generator.spawn_procs(per_host={kind: 1}), job


async def run(args, device: str) -> dict:
    trainer_procs, generator_procs, job = await spawn_procs(args, device)
    try:
        await setup_torch_elastic_env_async(trainer_procs)
        model = ModelConfig(flavor=args.flavor, max_seq_len=256)
        trainer = trainer_procs.spawn(
            "trainer",
            BenchTrainer,
            model=model,
            training=TrainingConfig(dtype=args.dtype),
            loss=LossConfig(),
            correction=CorrectionConfig(),
            vocab_size=args.vocab,
            device=device,
            seed=0,
        )
        engine = EngineConfig(dtype=args.dtype, max_num_seqs=4, max_seq_len=256, cuda_graphs=False)
        generator = generator_procs.spawn(
            "generator", GeneratorActor, model=model, engine=engine, vocab_size=args.vocab,
            device=device, gpu=args.generator_gpu if device == "cuda" else None,
        )  # fmt: skip
        backend = await broadcast_backend(trainer, [generator])
        transport = await choose_transport(trainer, [generator], "auto", backend)
        out = await trainer.publish_weights.call(args.dtype)
        packed = [p for p in out.values() if p is not None][0]
        results = {"chosen_transport": transport, "weight_bytes": packed.nbytes, "rows": {}}
        del out, packed
        for key, name, backend, changed in bench_rows(args, transport, device):
            sync = WeightSync(trainer, [generator], args.dtype, name)
            await sync.open(backend)
            row = await time_syncs(sync, trainer, args.repeats, changed)
            row.update(transport=name, backend=sync.backend, changed=changed)
            if TRANSPORTS[name].relay:
                side = functools.partial(trainer.weights_send.call, sync.key)
                row["trainer_side_median_s"] = (await time_calls(side, args.repeats))["median_s"]
            row.setdefault("bytes", results["weight_bytes"])
            await sync.close()
            results["rows"][key] = row
            print(f"{key}: {row}", flush=True)
        results["generator_version"] = await generator.policy_version.call_one()
        await generator.close.call_one()
        if args.hosts and "rdma" in args.transports:
            results["rows"]["rdma"] = await time_rdma(trainer_procs, generator_procs, args, results)
        return results
    finally:
        await asyncio.gather(trainer_procs.stop(), generator_procs.stop())
        if job is not None:
            job.kill()


def bench_rows(args, chosen: str, device: str) -> list[tuple[str, str, str | None, float]]:
    """(row key, transport, group backend (None: the one picked), fraction changed per
    sync) for each row asked for: cuda_ipc only where "auto" would pick it; a group
    transport on GPUs also through CPU buffers (gloo); delta once per --changed."""
    rows = []
    for asked in args.transports:
        name = {"full": "broadcast"}.get(asked, asked)
        if name not in TRANSPORTS or (name == "cuda_ipc" and chosen != "cuda_ipc"):
            continue
        fractions = args.changed if name == "delta" else [0.0]
        backends = [None] if TRANSPORTS[name].relay or device != "cuda" else [None, "gloo"]
        for backend in backends:
            for f in fractions:
                key = (
                    asked
                    + (f"_{backend}" if backend else "")
                    + (f"_{f:g}" if name == "delta" else "")
                )
                rows.append((key, name, backend, f))
    return rows


async def time_syncs(sync, trainer, repeats: int, changed: float) -> dict:
    """Seconds per sync: one cold, then `repeats` timed, each after the trainer moved
    `changed` of its weights (a simulated RL step, outside the time); bytes sent per warm
    sync (the delta sender's count, when it is one)."""
    times, sent = [], []
    for i in range(repeats + 1):
        if changed:
            await trainer.perturb.call(changed, i)
        times.append(await _timed(sync))
        last = [x for x in (await trainer.last_send.call()).values() if x is not None]
        sent.extend(x["bytes"] for x in last[:1] if i)
    row = {"cold_s": times[0], "median_s": statistics.median(times[1:]), "min_s": min(times[1:])}
    if sent:
        row["bytes"] = statistics.median(sent)
    return row


async def time_rdma(trainer_procs, generator_procs, args, results) -> dict:
    """The RDMABuffer row: the same bytes pulled across hosts, transfer only."""
    from monarch.rdma import get_rdma_backend

    nbytes = results["weight_bytes"]
    source = trainer_procs.spawn("rdma_source", RdmaSource, nbytes)
    sink = generator_procs.spawn("rdma_sink", RdmaSink, nbytes)
    handle = await source.handle.call_one()
    timing = await time_calls(lambda: sink.read.call_one(handle), args.repeats)
    timing["backend"] = get_rdma_backend()
    print(f"rdma: {timing}", flush=True)
    return timing


def main() -> None:
    args = parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    results = {
        "machine": torch.cuda.get_device_name() if device == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "shape": f"Qwen3 {args.flavor}, vocab {args.vocab}",
        "hosts": "2 simulated hosts (ProcessJob)" if args.hosts else "one host",
        "dtype": args.dtype,
        "repeats": args.repeats,
    }
    results.update(asyncio.run(run(args, device)))
    to = torch.device("cuda", args.generator_gpu) if device == "cuda" else None
    floor = copy_seconds(results["weight_bytes"], torch.device(device), to=to)
    results["generator_gpu"] = args.generator_gpu if device == "cuda" else None
    # one GPU: the copy reads and writes its memory; two: the bytes cross the link once
    moved = (1 if results["generator_gpu"] else 2) * results["weight_bytes"]
    results["floor"] = {"median_s": floor, "copy_GBps": moved / floor / 1e9}
    out = Path(args.out)
    out = out if out.suffix == ".json" else out / "bench_weight_sync.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print_table(results)


ROW_NAMES = {
    "cuda_ipc": "ours (same host): CUDA IPC handle, device copy",
    "broadcast": "{backend} broadcast, the whole buffer",
    "delta": "{backend} delta, {changed:.1%} of the weights changed",
    "controller": "packed CPU buffer through the controller",
}


def print_table(results: dict) -> None:
    print(
        f"\n{results['shape']}, {results['dtype']}, {results['weight_bytes'] / 1e6:,.1f} MB, "
        f"{results['hosts']}, {results['machine']}, median of {results['repeats']}"
    )
    head = f"| {'transport':<52} | {'sync ms':>9} | {'MB sent':>9} | {'GB/s':>6} | {'trainer side ms':>15} | {'cold ms':>9} |"
    print(head)
    print("|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:-1]) + "|")
    gb = results["weight_bytes"] / 1e9
    for key, r in results["rows"].items():
        if key == "rdma":
            name = f"RDMABuffer read_into ({r.get('backend')}), transfer only"
        else:
            name = ROW_NAMES[r["transport"]].format(**r)
        side = r.get("trainer_side_median_s")
        side_text = f"{side * 1e3:>15.1f}" if side is not None else f"{'':>15}"
        sent = r.get("bytes", results["weight_bytes"]) / 1e6
        print(
            f"| {name:<52} | {r['median_s'] * 1e3:>9.1f} | {sent:>9.1f} | "
            f"{gb / r['median_s']:>6.2f} | {side_text} | {r['cold_s'] * 1e3:>9.1f} |"
        )
    f = results["floor"]
    how = "GPU 0 -> 1" if results.get("generator_gpu") else "read + write"
    floor_name = f"floor: one copy at {f['copy_GBps']:,.1f} GB/s ({how})"
    print(
        f"| {floor_name:<52} | {f['median_s'] * 1e3:>9.2f} | {'':>9} | "
        f"{gb / f['median_s']:>6.2f} | {'':>15} | {'':>9} |"
    )


if __name__ == "__main__":
    main()
    leave(0)  # skips Monarch's exit hook, which can time out after a run (see `leave`)
