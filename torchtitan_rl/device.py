"""Devices, process groups and the one dtype table of the package."""

from __future__ import annotations

import os
from typing import Literal, get_args

import torch
import torch.distributed as dist

DtypeName = Literal["float32", "bfloat16"]
"""The type of every config key that names a dtype (training.dtype, generator.dtype, ...)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Every dtype a config key may name (training.dtype, generator.dtype, exports, syncs)."""
DTYPE_NAMES = get_args(DtypeName)
assert set(DTYPE_NAMES) == set(DTYPES)


def pick_device(kind: str, cpu_threads: int = 0, gpu: int | None = None) -> torch.device:
    """The device for this process: GPU `gpu` (the placement's choice; default: its local
    rank's GPU) under "cuda"/"auto" when CUDA is present, else CPU (then torch uses
    `cpu_threads` threads in this process, when given)."""
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("parallelism.device: 'cuda' asked for, but no CUDA device is visible")
    if gpu is None:
        gpu = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def cap_gpu_memory(device: torch.device, gib: float, key: str) -> None:
    """Caps what torch's caching allocator may hold on `device` in this process at `gib`
    GiB (config key `key`; 0: no cap), so a process that would grow past its share of a
    shared GPU fails with CUDA out of memory instead of taking memory from its neighbour.
    Outside the cap: the CUDA context, NCCL's buffers and memory this process opened from
    another (CUDA IPC). Nothing off CUDA."""
    if not gib or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if gib * 2**30 > total:
        raise ValueError(
            f"{key}={gib} GiB is more than GPU {device.index}'s {total / 2**30:.2f} GiB; "
            f"use at most that, or 0 for no cap"
        )
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total, device)


def release_cached_memory(device: torch.device) -> None:
    """Hands the device memory torch's caching allocator holds unused back to the device,
    and first frees this process's blocks that other processes had opened by CUDA IPC and
    have let go of since: after a one-time buffer (a LoRA base sync's) is dropped, so a
    process sharing the GPU can use that memory. Nothing off CUDA."""
    if device.type == "cuda":
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


def describe_device(device: torch.device) -> dict:
    """Where this process computes, for the log and the run summary: host, pid, and on a GPU
    its index, UUID and the peak memory torch has reserved on it so far."""
    import socket

    where = {"host": socket.gethostname(), "pid": os.getpid(), "device": str(device)}
    if device.type == "cuda":
        where |= {
            "gpu": device.index,
            "uuid": str(torch.cuda.get_device_properties(device).uuid),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2),
        }
    return where


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device's queued work: a plain
    `.to("cuda")` of pageable memory synchronizes the stream, so it is staged through
    pinned memory (the caching host allocator keeps it until the copy is done)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def init_process_group(device: torch.device) -> tuple[int, int]:
    """Join the trainer's process group (env set by Monarch's elastic setup); (rank, world)."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()
