"""The frozen reference policy of the KL penalty (`loss.kl_coef > 0`).

It is a second PolicyModel on every trainer rank, sharded exactly like the policy (same
FSDP / TP layout; on one rank its frozen weights are plain tensors), never trained, and
kept in the training compute dtype: under bf16 mixed precision the policy computes with
its fp32 master weights rounded to bf16, so a bf16 reference gives the same numbers at
half the memory of an fp32 copy. Memory per rank: parameters x bytes of `training.dtype`
/ data-parallel ranks (Qwen3-0.6B in bf16: 1.2 GB over all ranks). Its log-probs of the
loss tokens come from the same fused head as the policy's (no [T, V] logits), at the
sampling temperature and over the replayed sampling support when there is one, so KL
compares the same two distributions the loss sees.

Where its weights come from: `loss.kl_reference` (a Hugging Face folder), else the policy
as RL starts (`copy_from` at the end of the warm start). Resuming restores it from the
checkpoint like the policy (`TrainerCore.state_dict`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule

from torchtitan_rl.models.lora import is_adapter
from torchtitan_rl.models.qwen3 import ModelConfig, PolicyModel, build_model
from torchtitan_rl.training.parallelize import copy_param_


class ReferencePolicy:
    def __init__(
        self,
        model_config: ModelConfig,
        *,
        hf_folder: str,
        vocab_size: int,
        device: torch.device,
        dtype: torch.dtype,
        shard: Callable[[PolicyModel], object],
    ):
        config = dataclasses.replace(model_config, hf_checkpoint=hf_folder)
        # the policy's RNG stream stays as it was
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.model = build_model(config, vocab_size, device).to(dtype)
        self.model.requires_grad_(False)
        self.model.eval()
        shard(self.model)
        self.from_hf = bool(hf_folder)
        """Loaded from `loss.kl_reference`: the policy never overwrites it."""

    @torch.no_grad()
    def copy_from(self, policy: PolicyModel, *, base_only: bool = False) -> None:
        """Take the policy's current weights (shards copied in place: same layout, but
        on one rank the frozen reference is plain tensors); `base_only`: all but the
        [lora] adapters."""
        own = dict(self.model.named_parameters())
        for name, param in policy.named_parameters():
            if not (base_only and is_adapter(name)):
                copy_param_(own[name], param.detach())
        self.release()

    @torch.no_grad()
    def logprobs(self, tensors: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """Reference log-probs of the microbatch's loss tokens (the trainer's `_tensors`)."""
        logprobs_N, _ = self.model(
            tensors["tokens_BS"],
            tensors["positions_BS"],
            tensors["document_ids_BS"],
            tensors["loss_index_N"],
            tensors["targets_N"],
            temperature,
            tensors.get("support"),
            tensors.get("branch_ids_BS"),
        )
        return logprobs_N

    def release(self) -> None:
        """Free gathered weights (CPU FSDP keeps them after a forward; the reference never
        changes, so between steps that is a saving, but not across a weight change)."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
