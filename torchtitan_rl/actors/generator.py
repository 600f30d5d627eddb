"""Monarch adapter for a generation engine (native `Engine` or `VllmEngine`, chosen by
`generator.backend`, built from its row in generation/backends.py): one actor per
generator process. Nothing below branches on the backend."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from monarch.actor import Actor, concurrent_endpoint

from torchtitan_rl.actors.fault_log import enable_fault_log
from torchtitan_rl.actors.process_exit import exit_at_stop
from torchtitan_rl.device import DTYPES, cap_gpu_memory, describe_device, pick_device
from torchtitan_rl.generation.backends import traits
from torchtitan_rl.generation.interface import (
    AdapterUse,
    EngineConfig,
    GenerationEngine,
    error_completion,
)
from torchtitan_rl.models.lora import LoRAConfig
from torchtitan_rl.models.model_config import ModelConfig
from torchtitan_rl.types import Completion, SamplingParams, ids_from_wire
from torchtitan_rl.weight_sync.lora_sync import Payload
from torchtitan_rl.weight_sync.packing import visible_cuda_uuids
from torchtitan_rl.weight_sync.sides import ReceivingSide


def build_engine(
    model: ModelConfig, engine: EngineConfig, vocab_size: int, device, hf_folder: str,
    lora: LoRAConfig | None = None,
) -> GenerationEngine:  # fmt: skip
    """The engine `engine.backend` names, with the policy's weights (`hf_folder` for a
    backend that starts from one: generation/backends.py), taking [lora] versions as `lora`
    says (its `adapter_use`)."""
    return traits(engine.backend).build(model, engine, vocab_size, device, hf_folder, lora)


class GeneratorActor(Actor):
    """Serves many concurrent `generate` calls; they coalesce in the engine's running batch."""

    def __init__(
        self,
        *,
        model: ModelConfig,
        engine: EngineConfig,
        vocab_size: int,
        device: str,
        cpu_threads: int = 0,
        actor_name: str = "generator",
        log_dir: str | None = None,
        hf_folder: str = "",
        gpu: int | None = None,
        lora: LoRAConfig | None = None,
    ):
        """`hf_folder`: where the vllm backend starts from (the policy exported by the
        trainer, or model.hf_checkpoint); unused by the native engine. `gpu`: the GPU the
        placement gave this replica (None: GPU 0). `lora`: the run's [lora] section (how a
        vLLM engine takes its versions: lora.vllm_sync; where the native one keeps the
        base: lora.generator_base)."""
        self.fault_log = enable_fault_log(log_dir, actor_name, 0)
        exit_at_stop()
        self.actor_name = actor_name
        # sets the current GPU for this thread, which in Monarch 0.7 also runs every endpoint
        dev = self.device = pick_device(device, cpu_threads, gpu)
        cap_gpu_memory(dev, engine.gpu_memory_gib, "generator.gpu_memory_gib")
        self.engine = build_engine(model, engine, vocab_size, dev, hf_folder, lora)
        base = lora.generator_base if lora is not None else "auto"
        cap = int(engine.gpu_memory_gib * 2**30)
        self.sync_side = ReceivingSide(dev, self.engine.adapter_use, base, cap)
        """This generator's half of the current weight sync (weight_sync/sides.py)."""

    @concurrent_endpoint
    async def generate(
        self,
        prompt_ids: np.ndarray | bytes,
        request_id: str,
        session_id: str | None,
        sampling: SamplingParams,
    ) -> Completion:
        """One turn; `prompt_ids` int32 ids, or their bytes (`types.ids_to_wire`)."""
        try:
            return await self.engine.generate(
                ids_from_wire(prompt_ids),
                request_id=request_id,
                session_id=session_id,
                sampling=sampling,
            )
        except Exception as e:  # an escaping error would kill the actor: report it per request
            return error_completion(request_id, f"{type(e).__name__}: {e}")

    @concurrent_endpoint
    async def cuda_uuids(self) -> list[str]:
        """GPUs this process can open (a trainer GPU among them allows "cuda_ipc")."""
        return visible_cuda_uuids()

    @concurrent_endpoint
    async def weights_base(self) -> int | None:
        """The id of the [lora] base this generator holds (-1: none); None when its engine
        takes the merged full weights only (`AdapterUse.FULL`)."""
        if self.sync_side.adapter_use is AdapterUse.FULL:
            return None
        return self.sync_side.held_base

    @concurrent_endpoint
    async def weights_join(
        self, key: str, transport: str, offer: Any, rank: int,
        payload: Payload = Payload.FULL, base_id: int = -1,
    ) -> None:  # fmt: skip
        """Become member `rank` of weight sync `key` (its transport's group, if it has one),
        leaving the sync joined before; returns once the group has formed (the trainer's
        `weights_form` runs meanwhile). `payload`, `base_id`: what the sync moves
        (weight_sync/lora_sync.py)."""
        await self.sync_side.join(key, transport, offer, rank, payload, base_id)

    @concurrent_endpoint
    async def weights_receive(self, key: str, payload: Any, index: int) -> int:
        """Receive the next version by sync `key`'s transport (`payload`: what the trainer
        returned, for a transport through the controller) into memory of this process's
        own, then queue what the engine loads for it (adapters: merged with the base as the
        engine copies them in, or the adapters themselves for an engine that serves them);
        the engine applies it between steps. Returns the version."""
        version, load = await self.sync_side.take(
            key, payload, index, DTYPES[self.engine.config.dtype]
        )
        if load is not None:
            state, partial = load
            self.engine.load_weights(state, version, partial=partial)
        return version

    @concurrent_endpoint
    async def weights(self) -> dict[str, torch.Tensor]:
        """The weights the engine computes with now, as CPU tensors (tests, debugging): the
        native engine's by our names; vLLM's by its names, in its fused layouts (qkv_proj,
        gate_up_proj)."""
        return {k: v.detach().cpu() for k, v in self.engine.model_parameters()}

    @concurrent_endpoint
    async def engine_stats(self) -> dict[str, float]:
        """Counters since start: the native engine's steps (`Engine.stats`) and eager
        prefills (`ModelRunner.eager`), and both engines' driver seconds (busy, pulling
        weights; `EngineFront.loop_seconds`)."""
        runner = getattr(self.engine, "runner", None)
        return {
            **getattr(self.engine, "stats", {}),
            **(runner.eager if runner is not None else {}),
            **getattr(self.engine, "loop_seconds", {}),
        }

    @concurrent_endpoint
    async def policy_version(self) -> int:
        return self.engine.policy_version

    @concurrent_endpoint
    async def where(self) -> dict:
        """This process's host, process and GPU (index, UUID, peak memory)."""
        return {"role": self.actor_name, "rank": 0, **describe_device(self.device)}

    @concurrent_endpoint
    async def pid(self) -> int:
        """This process's id (fault drills kill it)."""
        return os.getpid()

    @concurrent_endpoint
    async def close(self) -> None:
        await self.engine.close()
        self.sync_side.close()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
