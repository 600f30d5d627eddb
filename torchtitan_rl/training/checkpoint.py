"""Trainer state on disk through torch.distributed.checkpoint (DCP): every rank writes its
own shards into one folder, so saving never gathers the model on one process.

    <folder>/.metadata          written by rank 0 once every rank's shards are in
    <folder>/__<rank>_0.distcp  each rank's shards of model, optimizer, scheduler, counters

The folder is one piece of a checkpoint; `controller.checkpoints.CheckpointStore` makes the whole
checkpoint atomic (temp folder, completion marker, rename).

A one-rank trainer saves and loads without DCP's collectives (`no_dist`): on CPU with 2+
torch threads, one gloo collective of a large payload (DCP's gather of the save plans) made
every later train step of that process ~40% slower (scripts/bench_checkpoint_slowdown.py).
It looks like libgomp's wait policy: the process gains an OpenMP thread, and with more
OpenMP threads than cores libgomp stops spinning between parallel regions; with
OMP_WAIT_POLICY=PASSIVE the steps are as slow from the start.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchtitan_rl.training.trainer import TrainerCore


def save_trainer_state(core: TrainerCore, folder: str | Path) -> None:
    """Write `core.state_dict()` under `folder`. A collective: every trainer rank calls it."""
    dcp.save(core.state_dict(), checkpoint_id=str(folder), no_dist=_one_rank())


def load_trainer_state(core: TrainerCore, folder: str | Path) -> int:
    """Load a folder written by `save_trainer_state` into `core`; returns the policy version.

    Every trainer rank calls it; the world size may differ from the one that saved (DCP
    reshards), the model shape may not.
    """
    state = core.state_dict()  # the template DCP fills in place (shapes, shardings)
    dcp.load(state, checkpoint_id=str(folder), no_dist=_one_rank())
    core.load_state_dict(state)
    return core.policy_version


def _one_rank() -> bool:
    """No process group, or a group of one: DCP has nothing to coordinate."""
    return not dist.is_initialized() or dist.get_world_size() == 1
