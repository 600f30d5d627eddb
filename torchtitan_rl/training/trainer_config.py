"""Config sections owned by the trainer: optimisation and the supervised warm start."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from torchtitan_rl.checks import check_range
from torchtitan_rl.device import DTYPE_NAMES, DtypeName


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """TOML section [training]."""

    steps: int = 100
    """RL steps (one rollout batch and one optimizer step each)."""
    stop_after: int = 0
    """End the run cleanly after this RL step, as a preemption would; 0 runs all steps."""
    lr: float = 3e-4
    """AdamW learning rate after warmup, finite and > 0."""
    warmup_steps: int = 0
    """Linear learning-rate warmup, in optimizer steps (>= 0)."""
    lr_decay_to: float = 1.0
    """Learning rate at the last RL step as a fraction of `lr`, in [0, 1], reached by cosine
    decay after the warmup (over steps x minibatches optimizer steps); 1 keeps it constant."""
    minibatches: int = 1
    """Optimizer steps per RL step: the step's groups are split into this many minibatches
    of whole groups (so at most rollout.prompts_per_step); weights go to the generator once,
    after the last."""
    weight_decay: float = 0.0
    """AdamW weight decay, finite and >= 0."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm, finite and >= 0; 0 disables."""
    dtype: DtypeName = "float32"
    """Parameter dtype for forward/backward: "float32" or "bfloat16" (GPU)."""
    compile: bool = False
    """Compile each transformer block with torch.compile (one graph per block: norms, RoPE,
    attention and MLP fused by Inductor). The first step pays the compilation; meant for GPU,
    works on CPU too."""
    gpu_memory_gib: float = 0.0
    """Most GPU memory torch may hold in each trainer process, in GiB (>= 0; 0: no cap); a
    step that needs more fails with CUDA out of memory. For a GPU shared with a generator
    (parallelism.placement = "shared"): with generator.gpu_memory_gib it splits the GPU.
    The CUDA context (~0.5 GiB) is outside it. No effect on CPU."""

    def lr_factor(self, step: int) -> float:
        """The learning rate of optimizer step `step` (from 0), as a fraction of `lr`."""
        warmup = max(self.warmup_steps, 0)
        if step < warmup:
            return (step + 1) / (warmup + 1)
        span = self.steps * self.minibatches - 1 - warmup
        done = min(1.0, (step - warmup) / span) if span > 0 else 1.0
        return self.lr_decay_to + (1 - self.lr_decay_to) * 0.5 * (1 + math.cos(math.pi * done))

    @property
    def last_step(self) -> int:
        """The RL step a run ends after: `steps`, or `stop_after` when it is set."""
        return min(self.steps, self.stop_after) if self.stop_after else self.steps

    def validate(self) -> None:
        check_range("training.lr_decay_to", self.lr_decay_to, ge=0, le=1)
        check_range("training.steps", self.steps, ge=0)
        check_range("training.stop_after", self.stop_after, ge=0)
        check_range("training.minibatches", self.minibatches, ge=1)
        check_range("training.lr", self.lr, gt=0)
        check_range("training.warmup_steps", self.warmup_steps, ge=0)
        check_range("training.weight_decay", self.weight_decay, ge=0)
        check_range("training.max_grad_norm", self.max_grad_norm, ge=0)
        check_range("training.gpu_memory_gib", self.gpu_memory_gib, ge=0)
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"training.dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"training.compile must be true or false, got {self.compile!r}")


WarmStartParams = Literal["auto", "all", "adapters"]

TARGET_LOSS_WINDOW = 10
"""Warm-start steps whose mean loss `WarmStartConfig.target_loss` compares (one step's loss
moves by ~0.1 between batches)."""


@dataclass(kw_only=True, slots=True)
class WarmStartConfig:
    """TOML section [warm_start]: supervised steps on env demonstrations before RL.

    A random-init model earns no reward, so RL alone has no signal; a short warm start on
    gold answers gives it one. Gains are counted from the first RL step.
    """

    steps: int = 0
    """Supervised steps; 0 skips the warm start."""
    batch_size: int = 32
    """Demonstrations per step."""
    lr: float = 2e-3
    """Learning rate of the warm start, finite and > 0 (its own AdamW state, dropped before
    RL)."""
    target_loss: float = 0.0
    """Finite and >= 0. Stop early once the mean loss of the last 10 steps is at or below this (`steps` is
    then the most it runs), so every seed starts RL from a model as far along; 0 runs all
    `steps` (as does a cap below 10 steps, e.g. a short smoke run)."""
    params: WarmStartParams = "auto"
    """What the warm start trains when [lora] is on (without it: every weight). "all": every
    weight, as full fine-tuning, then RL trains fresh adapters on that warm-started base
    (the checkpoint then holds the base; the KL reference "base" is it). "adapters": the
    adapters only, the base stays as loaded (LoRA-SFT, as PEFT/TRL train). "auto": "all"
    for a random-init model (its random embeddings and head, frozen, cannot learn the task
    through adapters), "adapters" for one loaded from model.hf_checkpoint."""

    def validate(self) -> None:
        check_range("warm_start.steps", self.steps, ge=0)
        check_range("warm_start.batch_size", self.batch_size, ge=1)
        check_range("warm_start.lr", self.lr, gt=0)
        check_range("warm_start.target_loss", self.target_loss, ge=0)

    def trains_all(self, *, lora: bool, hf_checkpoint: str) -> bool:
        """Whether the warm start trains every weight of a model with adapters (`lora`)
        loaded from `hf_checkpoint` ("" for a random init): `params`, "auto" resolved."""
        if not lora:
            return True
        return self.params == "all" or (self.params == "auto" and not hf_checkpoint)

    def reached_target(self, recent_losses: list[float]) -> bool:
        """Whether the warm start may stop: the last `TARGET_LOSS_WINDOW` losses average
        at or below `target_loss` (never with target_loss 0 or fewer losses)."""
        return (
            self.target_loss > 0
            and len(recent_losses) >= TARGET_LOSS_WINDOW
            and recent_mean(recent_losses) <= self.target_loss
        )


def recent_mean(losses: list[float]) -> float:
    """Mean of the last `TARGET_LOSS_WINDOW` losses (of all of them when fewer)."""
    window = losses[-TARGET_LOSS_WINDOW:]
    return sum(window) / len(window)
