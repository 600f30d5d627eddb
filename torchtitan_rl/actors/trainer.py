"""Monarch adapter for TrainerCore: one actor per trainer process, endpoints only."""

from __future__ import annotations

from monarch.actor import Actor, current_rank, endpoint

from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.models.qwen3 import ModelConfig
from torchtitan_rl.training.parallelize import init_process_group, pick_device
from torchtitan_rl.training.trainer import TrainerCore
from torchtitan_rl.training.trainer_config import TrainingConfig, WarmStartConfig
from torchtitan_rl.training.weight_sync import PackedWeights, pack_weights
from torchtitan_rl.types import Microbatch


class TrainerActor(Actor):
    """Endpoints are called on the whole trainer mesh at once (collectives inside)."""

    def __init__(
        self,
        model: ModelConfig,
        training: TrainingConfig,
        loss: LossConfig,
        correction: CorrectionConfig,
        vocab_size: int,
        device: str,
        seed: int,
        cpu_threads: int = 0,
    ):
        self.rank = current_rank().rank
        dev = pick_device(device, cpu_threads)
        init_process_group(dev)
        self.core = TrainerCore(
            model_config=model,
            training=training,
            loss=loss,
            correction=correction,
            vocab_size=vocab_size,
            device=dev,
            seed=seed,
        )
        self.sft_optimizer = None

    @endpoint
    async def train_step(self, batches: list[list[Microbatch]], temperature: float) -> dict:
        return self.core.train_step(batches[self.rank], temperature)

    @endpoint
    async def sft_step(self, batches: list[list[Microbatch]], warm_start: WarmStartConfig) -> dict:
        if self.sft_optimizer is None:
            self.sft_optimizer = self.core.warm_start_optimizer(warm_start)
        return self.core.sft_step(batches[self.rank], self.sft_optimizer)

    @endpoint
    async def end_warm_start(self) -> None:
        self.sft_optimizer = None

    @endpoint
    async def publish_weights(self) -> PackedWeights | None:
        """Every rank gathers; rank 0 returns the full weights as one packed buffer."""
        state = self.core.full_state_dict()
        if self.rank != 0:
            return None
        return pack_weights(state, self.core.policy_version)

    @endpoint
    async def logprobs(self, mb: Microbatch, temperature: float) -> list[float]:
        return self.core.logprobs(mb, temperature).tolist()
