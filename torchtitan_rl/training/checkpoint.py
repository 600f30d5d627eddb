"""Trainer state on disk through torch.distributed.checkpoint (DCP): every rank writes its
own shards into one folder, so saving never gathers the model on one process.

    <folder>/.metadata          written by rank 0 once every rank's shards are in
    <folder>/__<rank>_0.distcp  each rank's shards of model, optimizer, scheduler, counters

The folder is one piece of a checkpoint; `controller.checkpoints.CheckpointStore` makes the whole
checkpoint atomic (temp folder, completion marker, rename).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp

from torchtitan_rl.training.trainer import TrainerCore


def save_trainer_state(core: TrainerCore, folder: str | Path) -> None:
    """Write `core.state_dict()` under `folder`. A collective: every trainer rank calls it."""
    dcp.save(core.state_dict(), checkpoint_id=str(folder))


def load_trainer_state(core: TrainerCore, folder: str | Path) -> int:
    """Load a folder written by `save_trainer_state` into `core`; returns the policy version.

    Every trainer rank calls it; the world size may differ from the one that saved (DCP
    reshards), the model shape may not.
    """
    state = core.state_dict()  # the template DCP fills in place (shapes, shardings)
    dcp.load(state, checkpoint_id=str(folder))
    core.load_state_dict(state)
    return core.policy_version
