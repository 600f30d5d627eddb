"""Where each process of a run computes: asked of every actor at start and at the end, logged,
written to <run_dir>/processes.json and shown in the run summary.

    trainer rank 0   host-a pid 4121  GPU 0 GPU-5d1c...  peak 41.20 GiB
    generator        host-a pid 4180  GPU 1 GPU-9a07...  peak 52.81 GiB
"""

from __future__ import annotations

import asyncio
import json
import logging
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


def record_processes(run_dir: Path, processes: list[dict]) -> None:
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
