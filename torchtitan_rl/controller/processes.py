"""Where each process of a run computes: asked of every actor at start and at the end, logged,
written to <run_dir>/processes.json and shown in the run summary.

    trainer rank 0   host-a pid 4121  GPU 0 GPU-5d1c...  peak 41.20 GiB
    generator        host-a pid 4180  GPU 1 GPU-9a07...  peak 52.81 GiB
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path

logger = logging.getLogger(__name__)

FILE = "processes.json"


async def ask_processes(trainer, generators) -> list[dict]:
    """One record per trainer rank (rank order) and per generator replica (replica order)."""
    ranks = sorted((await trainer.where.call()).values(), key=lambda w: w["rank"])
    replicas = await asyncio.gather(*(g.where.call_one() for g in generators))
    return [*ranks, *replicas]


def describe(where: dict) -> str:
    """One line for one process (`where` as the actors' `where` endpoint returns it)."""
    role = f"{where['role']} rank {where['rank']}" if where["role"] == "trainer" else where["role"]
    line = f"{role:<16} {where['host']} pid {where['pid']}"
    if "gpu" in where:
        line += f"  GPU {where['gpu']} {where['uuid']}  peak {where['peak_reserved_gib']:.2f} GiB"
    else:
        line += f"  {where['device']}"
    return line


async def record_processes(run_dir: Path, trainer, generators) -> list[tuple[dict, int]]:
    """Ask every process where it computes, log each one's line and keep the list in the run
    folder for the summary; returns those on this host with their start times
    (`on_this_machine`)."""
    processes = await ask_processes(trainer, generators)
    write_processes(run_dir, processes)
    return on_this_machine(processes)


def write_processes(run_dir: Path, processes: list[dict]) -> None:
    """Log each process's line and keep the list in the run folder for the summary."""
    for where in processes:
        logger.info("process: %s", describe(where))
    (run_dir / FILE).write_text(json.dumps(processes, indent=1))


def process_lines(run_dir: Path) -> list[str]:
    """The summary's lines for the processes recorded in `run_dir` ([] when none)."""
    path = run_dir / FILE
    if not path.exists():
        return []
    return [f"procs    {describe(w)}" for w in json.loads(path.read_text())]


def started(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/<pid>/stat, field 22):
    with the pid it names one process, even after the pid is reused. None when it is gone
    (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def on_this_machine(processes: list[dict]) -> list[tuple[dict, int]]:
    """The records of `processes` that run on this host, each with its start time (never
    this process: an actor run in the controller's own process is not killed with it)."""
    host, me = socket.gethostname(), os.getpid()
    found = [(w, started(w["pid"])) for w in processes if w["host"] == host and w["pid"] != me]
    return [(w, t) for w, t in found if t is not None]


async def kill_leftovers(local: list[tuple[dict, int]], grace_s: float = 5.0) -> list[dict]:
    """SIGKILL the run's processes on this host that still run `grace_s` after their meshes
    were stopped, and log each: a mesh whose process is stuck (a trainer waiting in an NCCL
    broadcast to a generator that died) does not stop within its timeout. Several hosts'
    processes go with their job; this is the one-host launcher's equivalent. Returns the
    records killed."""
    deadline = time.monotonic() + grace_s
    alive = local
    while alive:
        alive = [(w, t) for w, t in alive if started(w["pid"]) == t]
        if not alive or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    for where, _ in alive:
        try:
            os.kill(where["pid"], signal.SIGKILL)
        except OSError:
            continue
        logger.warning("killed %s: it did not stop with its mesh", describe(where))
    return [w for w, _ in alive]
