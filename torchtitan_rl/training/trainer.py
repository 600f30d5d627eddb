"""The trainer core: one FSDP rank's model, optimizer and steps. No Monarch import.

Legend: R rows, S sequence length, N loss tokens of a microbatch.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from torchtitan_rl.losses.corrections import CorrectionConfig, correction_weights
from torchtitan_rl.losses.policy_loss import LossConfig, policy_loss
from torchtitan_rl.models.qwen3 import ModelConfig, PolicyModel, build_model
from torchtitan_rl.training.parallelize import (
    apply_compile,
    apply_fsdp,
    apply_tp_fsdp,
    held_gathered,
)
from torchtitan_rl.training.trainer_config import TrainingConfig, WarmStartConfig
from torchtitan_rl.types import Microbatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TrainerCore:
    """Builds the policy on this rank, shards it when there are several ranks, trains it."""

    def __init__(
        self,
        *,
        model_config: ModelConfig,
        training: TrainingConfig,
        loss: LossConfig,
        correction: CorrectionConfig,
        vocab_size: int,
        device: torch.device,
        seed: int,
        tp: int = 1,
    ):
        self.training, self.loss_config, self.correction = training, loss, correction
        self.device = device
        # FSDP whenever a process group exists, one rank included: it carries the
        # mixed-precision policy (bf16 compute, fp32 master weights and reductions).
        self.distributed = dist.is_initialized()
        torch.manual_seed(seed)  # same init on every rank and in the generator
        self.model: PolicyModel = build_model(model_config, vocab_size, device)
        self.dp_group = None
        """Group the batch is split over: None = every rank; under tensor parallelism the
        `tp` ranks of one group hold the same microbatches and count them once."""
        if self.distributed and tp > 1:
            mesh = apply_tp_fsdp(self.model, device, DTYPES[training.dtype], tp)
            self.dp_group = mesh["dp"].get_group()
        elif self.distributed:
            apply_fsdp(self.model, device, DTYPES[training.dtype])
        elif tp > 1:
            raise ValueError(f"parallelism.tp={tp} needs a process group of tp ranks")
        if training.compile:
            apply_compile(self.model)
        self.dp_rank = dist.get_rank() // tp if self.distributed else 0
        """Which of the batcher's per-rank microbatch lists this rank trains on."""
        self.policy_version = 0
        self.optimizer = self._adamw(training.lr)
        warmup = max(training.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)) if warmup else 1.0
        )
        self.skipped_steps = 0

    def _adamw(self, lr: float) -> torch.optim.Optimizer:
        # One fused kernel over all parameters on GPU. On CPU the foreach implementation
        # (same arithmetic, bit for bit) dispatches each op once per parameter list, not once
        # per parameter, and the default picks the per-parameter loop there.
        cuda = self.device.type == "cuda"
        return torch.optim.AdamW(
            self.model.parameters(),
            lr=lr,
            weight_decay=self.training.weight_decay,
            fused=cuda,
            foreach=not cuda,
        )

    # ---- forward ----------------------------------------------------------------------
    def _tensors(self, mb: Microbatch) -> dict[str, torch.Tensor]:
        def to(a, dtype):
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype)

        loss_index_N = torch.from_numpy(np.flatnonzero(mb.loss_mask_RS.reshape(-1))).to(self.device)
        flat = {k: getattr(mb, k).reshape(-1) for k in ("labels_RS", "logprobs_RS")}
        flat["advantages_RS"] = mb.advantages_RS.reshape(-1)
        flat["sequence_ids_RS"] = mb.sequence_ids_RS.reshape(-1)
        idx = loss_index_N.cpu().numpy()
        out = {
            "tokens_BS": to(mb.input_ids_RS, torch.long),
            "positions_BS": to(mb.positions_RS, torch.long),
            "document_ids_BS": to(mb.document_ids_RS, torch.long),
            "loss_index_N": loss_index_N,
            "targets_N": to(flat["labels_RS"][idx], torch.long),
            "generator_logprobs_N": to(flat["logprobs_RS"][idx], torch.float32),
            "advantages_N": to(flat["advantages_RS"][idx], torch.float32),
            "sequence_ids_N": to(flat["sequence_ids_RS"][idx], torch.long),
        }
        if mb.support_ids is not None:
            out["support"] = (to(mb.support_ids, torch.long), to(mb.support_offsets, torch.long))
        return out

    def _logprobs(self, t: dict[str, torch.Tensor], temperature: float):
        return self.model(
            t["tokens_BS"],
            t["positions_BS"],
            t["document_ids_BS"],
            t["loss_index_N"],
            t["targets_N"],
            temperature,
            t.get("support"),
        )

    # ---- steps ------------------------------------------------------------------------
    def train_step(self, microbatches: list[Microbatch], temperature: float) -> dict[str, float]:
        """One RL optimizer step over this rank's microbatches; returns global metrics."""
        self.model.train()
        sums: dict[str, float] = {}
        diff_max = torch.zeros((), device=self.device)
        total_loss = torch.zeros((), device=self.device)
        with held_gathered(self.model):  # one all-gather per step on CPU
            for mb in microbatches:
                t = self._tensors(mb)
                logprobs_N, entropy_N = self._logprobs(t, temperature)
                weights_N, corr_metrics = None, {}
                if self.correction.level != "none" or self.correction.opsm_delta > 0:
                    weights_N, corr_metrics = correction_weights(
                        logprobs_N.detach(),
                        t["generator_logprobs_N"],
                        t["advantages_N"],
                        t["sequence_ids_N"],
                        config=self.correction,
                        num_sequences=mb.num_global_sequences,
                    )
                loss, metrics = policy_loss(
                    logprobs_N,
                    t["generator_logprobs_N"],
                    t["advantages_N"],
                    t["sequence_ids_N"],
                    config=self.loss_config,
                    num_global_tokens=mb.num_global_loss_tokens,
                    num_global_sequences=mb.num_global_sequences,
                    entropy_N=entropy_N,
                    correction_weights_N=weights_N,
                )
                loss.backward()
                total_loss += loss.detach()
                n = float(t["targets_N"].numel())
                for k, v in {**metrics, **corr_metrics}.items():
                    if k.endswith(("_min", "_max", "num_tokens")):
                        continue
                    sums[k] = sums.get(k, 0.0) + float(v) * n
                sums["_tokens"] = sums.get("_tokens", 0.0) + n
                if mb.support_offsets is not None:  # sampling-mask replay: ids kept per token
                    kept = float(np.diff(mb.support_offsets.astype(np.int64)).sum())
                    sums["trainer/kept_vocab_per_token"] = (
                        sums.get("trainer/kept_vocab_per_token", 0.0) + kept
                    )
                finite = torch.isfinite(t["generator_logprobs_N"])
                if finite.any():
                    gap = (logprobs_N.detach() - t["generator_logprobs_N"]).abs()[finite]
                    diff_max = torch.maximum(diff_max, gap.max())
                    sums["trainer/logprob_diff/mean"] = sums.get(
                        "trainer/logprob_diff/mean", 0.0
                    ) + float(gap.sum())
                    sums["_finite"] = sums.get("_finite", 0.0) + float(finite.sum())
        out = self._reduce(sums, total_loss, diff_max)
        out.update(self._optimizer_step(self.optimizer, out["loss/mean"]))
        self.scheduler.step()
        out["trainer/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def sft_step(self, microbatches: list[Microbatch], optimizer) -> dict[str, float]:
        """One supervised step: mean negative log-likelihood of the loss-mask tokens."""
        self.model.train()
        total = torch.zeros((), device=self.device)
        with held_gathered(self.model):  # one all-gather per step on CPU
            for mb in microbatches:
                t = self._tensors(mb)
                logprobs_N, _ = self._logprobs(t, 1.0)
                loss = -logprobs_N.sum() / max(mb.num_global_loss_tokens, 1)
                loss.backward()
                total += loss.detach()
        if self.distributed:
            dist.all_reduce(total, group=self.dp_group)
        out = {"warm_start/loss": float(total)}
        out.update(self._optimizer_step(optimizer, out["warm_start/loss"]))
        return out

    def _optimizer_step(self, optimizer, loss: float) -> dict[str, float]:
        clip = self.training.max_grad_norm if self.training.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norm = float(norm)
        if not (math.isfinite(norm) and math.isfinite(loss)):
            self.skipped_steps += 1  # never apply a non-finite update
        else:
            optimizer.step()
            self.policy_version += 1
        optimizer.zero_grad(set_to_none=True)
        return {
            "trainer/grad_norm": norm,
            "trainer/skipped_steps": float(self.skipped_steps),
            "trainer/policy_version": float(self.policy_version),
        }

    def _reduce(self, sums: dict[str, float], total_loss, diff_max) -> dict[str, float]:
        """Sum the per-rank sums (max for the log-prob gap) over ranks; ranks may differ in
        which keys they saw (an all-padding microbatch reports none), so gather dicts."""
        local = {**sums, "_loss": float(total_loss), "_diff_max": float(diff_max)}
        parts = [local]
        if self.distributed:
            parts = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(parts, local, group=self.dp_group)
        merged: dict[str, float] = {}
        for part in parts:
            for k, v in part.items():
                merged[k] = (
                    max(merged.get(k, 0.0), v) if k == "_diff_max" else merged.get(k, 0.0) + v
                )
        tokens, finite = merged.pop("_tokens", 0.0), merged.pop("_finite", 0.0)
        out = {
            "loss/mean": merged.pop("_loss"),
            "trainer/logprob_diff/max": merged.pop("_diff_max"),
        }
        for k, v in merged.items():
            denom = finite if k == "trainer/logprob_diff/mean" else tokens
            out[k] = v / denom if denom else 0.0
        out["trainer/loss_tokens"] = tokens
        return out

    # ---- weights ----------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) fp32 CPU weights; a collective: every rank must call it."""
        if self.distributed:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(self.model, options=options)
        else:
            state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        return {k: v.float() for k, v in state.items()}

    # ---- checkpoint ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Model, optimizer, LR scheduler and counters in torch.distributed.checkpoint form:
        under FSDP each rank holds its own shards (DTensors). A collective.

            {"model": {fqn: tensor}, "optimizer": {"state": ..., "param_groups": ...},
             "scheduler": LambdaLR.state_dict(), "policy_version": int, "skipped_steps": int}
        """
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "policy_version": self.policy_version,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (after torch.distributed.checkpoint filled it)."""
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.policy_version = int(state["policy_version"])
        self.skipped_steps = int(state["skipped_steps"])

    @torch.no_grad()
    def logprobs(self, mb: Microbatch, temperature: float = 1.0) -> np.ndarray:
        """Trainer log-probs of mb's loss tokens (row-major), for checks and diagnostics."""
        self.model.eval()
        with held_gathered(self.model):
            logprobs_N, _ = self._logprobs(self._tensors(mb), temperature)
        return logprobs_N.float().cpu().numpy()

    def warm_start_optimizer(self, config: WarmStartConfig) -> torch.optim.Optimizer:
        return self._adamw(config.lr)
