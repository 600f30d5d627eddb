"""Moving a packed weight buffer from one GPU to another process on another GPU of the same
host: CUDA IPC (what the run uses: the receiver opens the sender's buffer once and copies it
at every sync) against an NCCL broadcast in a 2-rank group, with the in-process peer copy as
the floor. Transport only: both pay the same gather and pack on the trainer before this.

    python scripts/bench_gpu_transport.py                 # 0.6B and 4B bf16 sizes, GPUs 0 -> 1
    python scripts/bench_gpu_transport.py --sizes-mb 64   # any sizes

Needs 2 GPUs. Median of --repeats after one warm-up; the receiver's clock, from the moment
both sides are ready (a barrier) to the copy being on its GPU. Writes bench_gpu_transport.json
to --out (default: $OUT, else the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

SHAPES_MB = {"Qwen3 0.6B bf16": 1192, "Qwen3 4B bf16": 8044}
"""Packed bf16 sizes: the 0.6B measured by bench_weight_sync.py (tied embedding once); 4B
from its 4.02B parameters (tied)."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mb", type=int, nargs="*", default=[], help="instead of the shapes")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--smoke", action="store_true", help="CPU: gloo broadcast of 8 MB, no IPC")
    args = p.parse_args()
    if args.smoke:
        args.sizes_mb, args.repeats = [8], 2
    return args


def _median_s(fn, repeats: int, barrier: bool = True) -> float:
    times = []
    for _ in range(repeats + 1):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy(dst: torch.Tensor, src: torch.Tensor):
    def copy():
        dst.copy_(src)
        _sync(dst.device)

    return copy


def _broadcast(buf: torch.Tensor):
    def broadcast():
        dist.broadcast(buf, src=0)
        _sync(buf.device)

    return broadcast


def _one_size(rank: int, mb: int, repeats: int, gloo) -> dict | None:
    """Both ranks: NCCL broadcast, then CUDA IPC; rank 1 also times the peer-copy floor and
    returns the row. On CPU (--smoke): a gloo broadcast and a memory copy, no IPC."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    buf = torch.empty(mb * 2**20 // 2, dtype=torch.bfloat16, device=dev)
    if rank == 0:
        buf.normal_()
    _sync(dev)
    nccl_s = _median_s(_broadcast(buf), repeats)
    if not cuda:
        floor_s = _median_s(_copy(torch.empty_like(buf), buf), repeats, barrier=False)
        return (
            {"mb": mb, "cuda_ipc_s": None, "nccl_s": nccl_s, "floor_s": floor_s} if rank else None
        )
    # CUDA IPC: rank 0 shares its buffer; rank 1 opens it once, then copies at every sync
    handle = [reduce_tensor(buf) if rank == 0 else None]
    dist.broadcast_object_list(handle, src=0, group=gloo)
    if rank == 0:
        _median_s(lambda: None, repeats)  # keeps the barriers paired; the buffer stays alive
        dist.barrier()
        return None
    rebuild, args = handle[0]
    src = rebuild(*args)
    ipc_s = _median_s(_copy(buf, src), repeats)
    del src
    dist.barrier()
    peer = torch.empty_like(buf, device="cuda:0")
    floor_s = _median_s(_copy(buf, peer), repeats, barrier=False)
    return {"mb": mb, "cuda_ipc_s": ipc_s, "nccl_s": nccl_s, "floor_s": floor_s}


def _worker(rank: int, sizes: dict[str, int], repeats: int, port: int, queue) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if torch.cuda.is_available():
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=2)
    gloo = dist.new_group(backend="gloo")  # carries the IPC handle
    rows = {}
    for name, mb in sizes.items():
        row = _one_size(rank, mb, repeats, gloo)
        torch.cuda.empty_cache()
        dist.barrier()
        if row:
            rows[name] = row
    if rank == 1:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if torch.cuda.device_count() < 2 and not args.smoke:
        raise SystemExit("bench_gpu_transport needs 2 GPUs (--smoke runs on CPU)")
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sizes = {f"{mb} MB": mb for mb in args.sizes_mb} or SHAPES_MB
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(_worker, args=(sizes, args.repeats, 29517, queue), nprocs=2, join=True)
    rows = queue.get()
    machine = torch.cuda.get_device_name(0) if not args.smoke else "CPU (gloo for NCCL)"
    result = {"machine": machine, "torch": torch.__version__, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu_transport.json").write_text(json.dumps(result, indent=1))
    print(f"\nGPU 0 -> GPU 1, {result['machine']}, median of {args.repeats}")
    print("| buffer | CUDA IPC ms | NCCL broadcast ms | floor: peer copy ms | IPC GB/s |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        ipc = r["cuda_ipc_s"]
        ipc_ms, gbps = (
            (f"{ipc * 1e3:.1f}", f"{r['mb'] * 2**20 / ipc / 1e9:,.0f}")
            if ipc
            else ("needs 2 GPUs", "-")
        )
        print(
            f"| {name} | {ipc_ms} | {r['nccl_s'] * 1e3:.1f} | {r['floor_s'] * 1e3:.1f} | {gbps} |"
        )


if __name__ == "__main__":
    main()
