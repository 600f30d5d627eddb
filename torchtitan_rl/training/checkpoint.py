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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from torchtitan_rl.models.lora import is_adapter
from torchtitan_rl.training.trainer import TrainerCore


def save_trainer_state(core: TrainerCore, folder: str | Path) -> None:
    """Write `trainer_state(core)` under `folder`. A collective: every trainer rank calls it."""
    dcp.save(trainer_state(core), checkpoint_id=str(folder), no_dist=_one_rank())


def load_trainer_state(core: TrainerCore, folder: str | Path) -> int:
    """Load a folder written by `save_trainer_state` into `core`; returns the policy version.

    Every trainer rank calls it; the world size may differ from the one that saved (DCP
    reshards), the model shape may not.
    """
    if core.lora.enabled:  # before the adapters' shapes can fail to match, say why
        record = {"lora_base": ""}
        dcp.load(record, checkpoint_id=str(folder), no_dist=_one_rank())
        _adopt_base(core, record)  # a warm-started base: the template then asks for it
    state = trainer_state(core)  # the template DCP fills in place (shapes, shardings)
    dcp.load(state, checkpoint_id=str(folder), no_dist=_one_rank())
    restore_trainer_state(core, state)
    return core.policy_version


def trainer_state(core: TrainerCore) -> dict:
    """Model, optimizer, LR scheduler and counters in torch.distributed.checkpoint form:
    under FSDP each rank holds its own shards (DTensors). A collective.

        {"model": {fqn: tensor}, "optimizer": {"state": ..., "param_groups": ...},
         "scheduler": LambdaLR.state_dict(), "policy_version": int, "skipped_steps": int,
         "reference": {fqn: tensor}}   (the KL reference, only when loss.kl_coef > 0)

    With [lora] on, "model" and "reference" hold the adapters only (the frozen base is
    rebuilt from model.hf_checkpoint, or from model.flavor and job.seed, exactly as at
    the start), and "lora_base" (a JSON string, `lora.base_record`) names that base. When
    the warm start trained the base (`TrainerCore.base_warm_started`), "model" holds it
    too, once: the KL reference's base is the same frozen weights, copied on restore.
    """
    model, optimizer = get_state_dict(core.model, core.optimizer, options=_options(core))
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": core.scheduler.state_dict(),
        "policy_version": core.policy_version,
        "skipped_steps": core.skipped_steps,
    }
    if core.reference is not None:
        ref = get_model_state_dict(core.reference.model)
        state["reference"] = _trained_only(core, ref)
    if core.lora.enabled:
        state["lora_base"] = core.base
    return state


def _base_elsewhere(core: TrainerCore) -> bool:
    """[lora] with a base that config rebuilds: the checkpoint leaves the base out."""
    return core.lora.enabled and not core.base_warm_started


def _options(core: TrainerCore) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=_base_elsewhere(core), strict=True)


def _trained_only(core: TrainerCore, state: dict) -> dict:
    """[lora]: the adapter entries of a model state (the base is not saved)."""
    if not core.lora.enabled:
        return state
    return {k: v for k, v in state.items() if is_adapter(k)}


def _adopt_base(core: TrainerCore, state: dict) -> None:
    """The checkpoint's base must be this run's: as built, or (a fresh core only) that
    base as the warm start trained it, which the core then takes on (the checkpoint
    holds those weights)."""
    saved = state.get("lora_base")
    if not core.lora.enabled or saved == core.base:
        return
    if not core.base_warm_started and saved == core.base_record(warm_started=True):
        core.base, core.base_warm_started = saved, True
        return
    raise ValueError(
        f"the checkpoint's LoRA adapters belong to base {state.get('lora_base')}, "
        f"this run's is {core.base}; resume with that [model], job.seed and [lora]"
    )


def restore_trainer_state(core: TrainerCore, state: dict) -> None:
    """Restore what `trainer_state` returned (after torch.distributed.checkpoint filled it)."""
    _adopt_base(core, state)
    elsewhere = _base_elsewhere(core)
    set_state_dict(
        core.model,
        core.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(ignore_frozen_params=elsewhere, strict=not elsewhere),
    )  # fmt: skip
    if core.reference is not None:
        if "reference" not in state:
            raise ValueError("loss.kl_coef > 0, but the checkpoint holds no KL reference")
        set_model_state_dict(
            core.reference.model,
            state["reference"],
            options=StateDictOptions(strict=not core.lora.enabled),
        )
        if core.base_warm_started and not core.reference.from_hf:
            core.reference.copy_from(core.model, base_only=True)  # saved once, as the policy's
        core.reference.release()
    core.scheduler.load_state_dict(state["scheduler"])
    core.policy_version = int(state["policy_version"])
    core.skipped_steps = int(state["skipped_steps"])


def _one_rank() -> bool:
    """No process group, or a group of one: DCP has nothing to coordinate."""
    return not dist.is_initialized() or dist.get_world_size() == 1
