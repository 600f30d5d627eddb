"""Monarch adapter for TrainerCore: one actor per trainer process, endpoints only.

The trainer's own modules (TrainerCore, checkpoints, the Hugging Face and PEFT exports, and
through them torchtitan's model: 7-8 s of imports on a 2-core VM) are imported where the
actor runs, in its methods: the controller, which only names this class to spawn it, loads
without them."""

from __future__ import annotations

import os
from typing import Any

import torch
from monarch.actor import Actor, current_rank, endpoint

from torchtitan_rl.actors.fault_log import enable_fault_log
from torchtitan_rl.actors.process_exit import exit_at_stop
from torchtitan_rl.device import (
    DTYPES,
    cap_gpu_memory,
    describe_device,
    init_process_group,
    pick_device,
    release_cached_memory,
)
from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.models.lora import LoRAConfig, is_adapter, merged_full_state
from torchtitan_rl.models.model_config import ModelConfig
from torchtitan_rl.training.trainer_config import TrainingConfig, WarmStartConfig
from torchtitan_rl.types import Microbatch
from torchtitan_rl.weight_sync.lora_sync import NO_BASE, Payload, adapter_payload
from torchtitan_rl.weight_sync.packing import (
    PackedWeights,
    cuda_uuid,
    gather_into,
    pack_weights,
    sharded_state,
)
from torchtitan_rl.weight_sync.sides import SendingSide


class TrainerActor(Actor):
    """Endpoints are called on the whole trainer mesh at once (collectives inside)."""

    def __init__(
        self,
        *,
        model: ModelConfig,
        lora: LoRAConfig | None = None,
        training: TrainingConfig,
        loss: LossConfig,
        correction: CorrectionConfig,
        vocab_size: int,
        device: str,
        seed: int,
        cpu_threads: int = 0,
        tp: int = 1,
        log_dir: str | None = None,
        gpus: tuple[int, ...] = (),
    ):
        """`gpus`: the GPU of each trainer rank on its host, by local rank (the placement);
        empty: the local rank's own index."""
        self.rank = current_rank().rank
        self.fault_log = enable_fault_log(log_dir, "trainer", self.rank)
        exit_at_stop()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        dev = pick_device(device, cpu_threads, gpus[local] if gpus else None)
        cap_gpu_memory(dev, training.gpu_memory_gib, "training.gpu_memory_gib")
        init_process_group(dev)
        from torchtitan_rl.training.trainer import TrainerCore  # here: module docstring

        self.core = TrainerCore(
            model_config=model,
            training=training,
            loss=loss,
            correction=correction,
            vocab_size=vocab_size,
            device=dev,
            seed=seed,
            tp=tp,
            lora=lora,
        )
        self.sft_optimizer = None
        self.sync_side = SendingSide(dev)
        """Rank 0's half of the current weight sync (weight_sync/sides.py)."""

    @endpoint
    async def train_step(
        self, updates: list[list[list[Microbatch]]], temperature: float
    ) -> dict[str, float]:
        """One RL step; `updates[u][rank]` holds a data-parallel rank's microbatches of
        minibatch u (one optimizer step each)."""
        return self.core.train_step([u[self.core.dp_rank] for u in updates], temperature)

    @endpoint
    async def sft_step(self, batches: list[list[Microbatch]], warm_start: WarmStartConfig) -> dict:
        if self.sft_optimizer is None:
            self.sft_optimizer = self.core.begin_warm_start(warm_start)
        return self.core.sft_step(batches[self.core.dp_rank], self.sft_optimizer)

    @endpoint
    async def end_warm_start(self) -> bool:
        """RL starts; True when the [lora] base changed (the warm start trained it): this
        process then sends it under a new id, so generators get it before adapters."""
        self.sft_optimizer = None
        changed = self.core.start_rl()
        if changed:
            self.sync_side.new_base()
        return changed

    @endpoint
    async def publish_weights(self, dtype: str = "float32") -> PackedWeights | None:
        """Every rank gathers; rank 0 returns the full weights as one packed CPU buffer in
        `dtype` ("float32" | "bfloat16"): the generator's dtype, so a bf16 generator gets
        half the bytes and the same values it would round to on load. Packed straight
        from the shards (no fp32 full copy of the model); same values as `weights_send`."""
        state = self.core.sync_state()
        if self.rank != 0:
            gather_into(state, None)
            return None
        return pack_weights(state, self.core.policy_version, DTYPES[dtype])

    @endpoint
    async def full_weights(self, dtype: str) -> dict[str, torch.Tensor] | None:
        """Rank 0: the full weights from torch's full state dict, cast to `dtype`: a
        reference independent of the packing path (tests, debugging). A collective."""
        state = self.core.full_state_dict()
        if self.rank != 0:
            return None
        return {k: v.to(DTYPES[dtype]) for k, v in state.items()}

    @endpoint
    async def cuda_uuid(self) -> str | None:
        """Rank 0's GPU (None on other ranks and on CPU): generators that see this GPU can
        take the "cuda_ipc" transport."""
        if self.rank != 0 or self.core.device.type != "cuda":
            return None
        return cuda_uuid(self.core.device)

    @endpoint
    async def weights_base(self) -> int | None:
        """Rank 0 with [lora] on: the id of the frozen base this process sends (a
        generator holding another one gets it before adapter-only syncs). Else None."""
        if self.rank != 0 or not self.core.lora.enabled:
            return None
        return self.sync_side.base_id

    @endpoint
    async def weights_open(
        self, key: str, transport: str, dtype: str, receivers: int, backend: str,
        payload: Payload = Payload.FULL,
    ) -> Any:  # fmt: skip
        """Rank 0 opens weight sync `key` (a strategy of weight_sync/strategies.py) for
        `receivers` generators, moving `payload` (weight_sync/lora_sync.py: FULL weights
        in `dtype`, the BASE in its own dtype, ADAPTERS in float32); returns what they
        need to join (or None). Replaces the sync opened before it. Other ranks: None."""
        if self.rank != 0:
            return None
        state = self._payload_state(payload, layout_only=True)  # rank 0 alone: no collective
        dtype = {
            Payload.FULL: DTYPES[dtype], Payload.ADAPTERS: torch.float32,
            Payload.BASE: next(iter(state.values())).dtype,
        }[Payload(payload)]  # fmt: skip
        base = self.sync_side.base_id if payload == Payload.ADAPTERS else NO_BASE
        return self.sync_side.open(
            key, transport, state=state, dtype=dtype, receivers=receivers, backend=backend,
            payload=payload, base_id=base,
        )  # fmt: skip

    @endpoint
    async def weights_form(self, key: str) -> None:
        """Rank 0 meets every generator of the sync (each in `weights_join` meanwhile)."""
        if self.rank == 0:
            self.sync_side.form(key)

    @endpoint
    async def weights_send(
        self, key: str, payload: Payload = Payload.FULL
    ) -> tuple[int, Any] | None:
        """Every rank gathers; rank 0 packs `payload` (the one sync `key` opened with) and
        sends it by the sync's transport; returns (version, what the controller passes to
        each generator: None for a group transport). FULL: the values of `publish_weights`."""
        state = self._payload_state(payload)
        if self.rank != 0:
            gather_into(state, None)
            if payload == Payload.BASE:  # its gathers' full tensors: once per generator
                release_cached_memory(self.core.device)
            return None
        return self.sync_side.send(key, state, self.core.policy_version)

    def _payload_state(self, payload: Payload, layout_only: bool = False) -> dict:
        """What a sync of `payload` packs; `layout_only`: the same layout without the
        merges' collectives (a FULL sync's merged weights have the base's layout)."""
        if payload == Payload.ADAPTERS:
            return adapter_payload(sharded_state(self.core.model), self.core.lora.scale)
        return self.core.sync_state(merge=payload == Payload.FULL and not layout_only)

    @endpoint
    async def weights_close(self, key: str) -> None:
        """Rank 0 drops sync `key` if it is still the current one (no collective)."""
        if self.rank == 0:
            self.sync_side.close(key)

    @endpoint
    async def save_checkpoint(self, folder: str) -> None:
        """Every rank writes its shards of model, optimizer, scheduler and counters."""
        from torchtitan_rl.training.checkpoint import save_trainer_state

        save_trainer_state(self.core, folder)

    @endpoint
    async def load_checkpoint(self, folder: str) -> int:
        """Every rank loads its shards; returns the restored policy version. A base the
        checkpoint holds (warm-started) is sent under a new id, as after the warm start."""
        from torchtitan_rl.training.checkpoint import load_trainer_state

        before = self.core.base
        version = load_trainer_state(self.core, folder)
        if self.core.base != before:
            self.sync_side.new_base()
        return version

    @endpoint
    async def export_hf(self, folder: str, hf_checkpoint: str, dtype: str) -> None:
        """Every rank gathers the full weights; rank 0 writes the Hugging Face folder. With
        [lora] on it holds the merged weights, and a PEFT adapter folder goes next to it
        (`<folder>_adapter`, models/peft_export.py)."""
        from torchtitan_rl.models.hf_export import export_hf
        from torchtitan_rl.models.peft_export import export_peft

        lora = self.core.lora.enabled
        state = self.core.full_state_dict(merged=False)
        adapters = self.core.adapters() if lora else None
        if self.rank != 0:
            return
        args = self.core.model.model_args
        merged = merged_full_state(state, self.core.lora.scale) if lora else state
        export_hf(merged, args, folder, hf_checkpoint=hf_checkpoint, dtype=dtype)
        if adapters is not None:
            base = {k: v for k, v in state.items() if not is_adapter(k)}
            export_peft(adapters, args, f"{folder}_adapter", hf_checkpoint=hf_checkpoint,
                        base_state=base, base_trained=self.core.base_warm_started,
                        dtype=dtype)  # fmt: skip

    @endpoint
    async def where(self) -> dict:
        """This rank's host, process and GPU (index, UUID, peak memory)."""
        return {"role": "trainer", "rank": self.rank, **describe_device(self.core.device)}

    @endpoint
    async def pid(self) -> int:
        """This process's id (fault drills kill it)."""
        return os.getpid()

    @endpoint
    async def logprobs(self, mb: Microbatch, temperature: float) -> list[float]:
        return self.core.logprobs(mb, temperature).tolist()
