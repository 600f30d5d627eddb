"""What this machine must offer a job before anything is written or a process spawned.

A config loads on any machine (tests and tools read job files written for others); these
checks ask the machine the run starts on, so they run once, at the start of `train.py`.
Each raises ValueError with one line naming the key, what this machine has, and what fits:

    generator.num_replicas=1000: each replica is a process of its own, and this machine
    gives the run 2 CPU cores; use generator.num_replicas <= 2
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torchtitan_rl.config import Config
from torchtitan_rl.controller.placement import Placement, plan


def check_machine(config: Config) -> Placement | None:
    """Every check below, for the job `config` on this machine; its GPU placement when the
    processes run here (launcher.kind "local" or "process"), None when they run elsewhere."""
    check_output_dir(config.job.output_dir)
    check_submit_host(config.launcher.kind)
    if config.launcher.kind not in ("local", "process"):  # the hosts are other machines
        config.weight_sync.check_run(on_gpus=config.parallelism.device != "cpu", one_host=False)
        return None
    placement = plan(config.parallelism, config.generator.num_replicas, config.generator.backend)
    if placement.gpus and config.launcher.kind == "process":
        raise ValueError(
            'launcher.kind = "process" simulates hosts on one machine, where every '
            'host would take GPU 0; valid with it: parallelism.device = "cpu"'
        )
    config.weight_sync.check_run(
        on_gpus=bool(placement.gpus), one_host=not config.launcher.multi_host
    )
    if not placement.gpus:
        check_cpu_procs(
            cores=usable_cores(),
            trainer_procs=config.parallelism.trainer_procs,
            replicas=config.generator.num_replicas,
        )
    return placement


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, cgroups' cpusets)."""
    return len(os.sched_getaffinity(0))


def check_cpu_procs(*, cores: int, trainer_procs: int, replicas: int) -> None:
    """On CPU each trainer rank and each generator replica is a process that computes at
    the same time as the rest of its role: a role with more processes than cores only
    timeslices (and gloo's collectives wait on the slowest), so it is refused."""
    for key, procs, what in (
        ("parallelism.trainer_procs", trainer_procs, "trainer rank"),
        ("generator.num_replicas", replicas, "generator replica"),
    ):
        if procs > cores:
            raise ValueError(
                f"{key}={procs}: each {what} is a CPU process of its own, and this machine "
                f"gives the run {cores} CPU core(s); use {key} <= {cores}"
            )


def check_output_dir(output_dir: str) -> None:
    """job.output_dir must be a folder this process can create run folders in: it, or the
    nearest of its parents that exists, is a writable directory."""
    path = Path(output_dir).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is under a file ({existing})"
        raise ValueError(f"job.output_dir={output_dir!r} {where}; use a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"job.output_dir={output_dir!r}: {existing} is not writable by this user; "
            "use a folder you can write to"
        )


def check_submit_host(kind: str) -> None:
    """launcher.kind = "slurm" submits with Slurm's `sbatch`, from this machine."""
    if kind == "slurm" and shutil.which("sbatch") is None:
        raise ValueError(
            'launcher.kind = "slurm" submits the job with Slurm\'s sbatch, which is not on '
            'PATH here; run from a Slurm login node, or use launcher.kind = "local"'
        )
