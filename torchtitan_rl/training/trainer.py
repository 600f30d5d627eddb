"""The trainer core: one FSDP rank's model, optimizer and steps. No Monarch import.

One RL step (`train_step`) is one or more updates (`training.minibatches`), each an
optimizer step over this rank's microbatches. With `loss.old_logprobs = "recompute"`, pi_old
of every microbatch of every update is computed first, by one no-grad forward through the
same fused head, so the PPO ratio pi_theta / pi_old starts at exactly 1 and later updates
measure their own staleness (losses/policy_loss.py has the per-token formulas).

Legend: R rows, S sequence length, N loss tokens of a microbatch.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchtitan_rl.device import DTYPES
from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.objective import microbatch_objective
from torchtitan_rl.losses.policy_loss import KL_REFERENCE_BASE, LossConfig
from torchtitan_rl.models import lora as lora_lib
from torchtitan_rl.models.lora import LoRAConfig
from torchtitan_rl.models.qwen3 import ModelConfig, PolicyModel, build_model
from torchtitan_rl.reductions import Metric, Metrics, merge, results
from torchtitan_rl.training.grad_clip import clip_grad_norm
from torchtitan_rl.training.parallelize import (
    apply_compile,
    apply_fsdp,
    apply_tp_fsdp,
    copy_param_,
    held_gathered,
)
from torchtitan_rl.training.reference import ReferencePolicy
from torchtitan_rl.training.trainer_config import TrainingConfig, WarmStartConfig
from torchtitan_rl.types import Microbatch
from torchtitan_rl.weight_sync.packing import sharded_state


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
        lora: LoRAConfig | None = None,
    ):
        self.training, self.loss_config, self.correction = training, loss, correction
        self.device = device
        self.distributed = dist.is_initialized()
        self.lora = lora or LoRAConfig()
        self.seed = seed
        self.model_config, self.vocab_size = model_config, vocab_size
        self.base = self.base_record(warm_started=False)
        """Which base weights (and adapter shape) this trainer's adapters belong to; the
        checkpoint records it and a resume must match it."""
        self.base_warm_started = False
        """[lora]: the warm start trained the base (`warm_start.params = "all"`), so no
        config can rebuild it: checkpoints hold it and exports write it out."""
        self.training_base = False
        """[lora]: the warm start is training every weight; until `start_rl` the policy is
        the model without adapters, as full training has it."""
        torch.manual_seed(seed)  # same init on every rank and in the generator
        # [lora]: built straight in the frozen base's dtype (the values of an fp32 build
        # cast to it, never a whole fp32 copy: the 8B shape's would be 28 GB)
        dtype = DTYPES[training.dtype] if self.lora.enabled else torch.float32
        self.model: PolicyModel = build_model(model_config, vocab_size, device, dtype)
        self._add_adapters(self.model)
        if tp > 1 and not self.distributed:
            raise ValueError(f"parallelism.tp={tp} needs a process group of tp ranks")
        self.tp = tp
        self.dp_group = self._shard(self.model)
        """Group the batch is split over: None = every rank; under tensor parallelism the
        `tp` ranks of one group hold the same microbatches and count them once."""
        if training.compile:
            apply_compile(self.model)
        self.dp_rank = dist.get_rank() // tp if self.distributed else 0
        """Which of the batcher's per-rank microbatch lists this rank trains on."""
        self.reference: ReferencePolicy | None = None
        self.base_reference = loss.kl_coef > 0 and loss.kl_reference == KL_REFERENCE_BASE
        """The KL reference is this model with its adapters disabled (no second model)."""
        if loss.kl_coef > 0 and not self.base_reference:
            self.reference = ReferencePolicy(
                model_config,
                hf_folder=loss.kl_reference,
                vocab_size=vocab_size,
                device=device,
                dtype=DTYPES[training.dtype],
                shard=self._shard_reference,
            )
            self.start_rl()  # the initial policy, until the warm start has run
        self.policy_version = 0
        self.optimizer = self._adamw(training.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, training.lr_factor)
        self.skipped_steps = 0

    def _add_adapters(self, model: PolicyModel) -> None:
        """With [lora] on: adapters on the targeted projections, the base frozen in the
        training dtype (models/lora.py). Before sharding, so FSDP/TP see the adapters."""
        if self.lora.enabled:
            base_dtype = DTYPES[self.training.dtype]
            lora_lib.add_adapters(model, self.lora, seed=self.seed, base_dtype=base_dtype)

    def _shard_reference(self, model: PolicyModel):
        """The KL reference has the policy's adapters too (frozen), so it can copy the
        policy as RL starts."""
        self._add_adapters(model)
        group = self._shard(model)
        model.requires_grad_(False)  # after sharding: TP's re-freeze marks adapters trainable
        return group

    def _shard(self, model: PolicyModel):
        """FSDP (and TP) over the trainer ranks; returns the data-parallel group (None: all).
        FSDP whenever a process group exists, one rank included: it carries the
        mixed-precision policy (bf16 compute, fp32 master weights and reductions); on one
        rank the frozen [lora] base stays outside it (`frozen_outside_fsdp`)."""
        if self.distributed and self.tp > 1:
            mesh = apply_tp_fsdp(model, self.device, DTYPES[self.training.dtype], self.tp)
            return mesh["dp"].get_group()
        if self.distributed:
            apply_fsdp(model, self.device, DTYPES[self.training.dtype])
        return None

    def base_record(self, *, warm_started: bool) -> str:
        """This trainer's `lora.base_record` (JSON), the base as built or as warm-started."""
        return lora_lib.base_record(
            self.model_config, self.seed, self.lora, vocab_size=self.vocab_size,
            dtype=self.training.dtype, device=self.device.type, warm_started=warm_started,
        )  # fmt: skip

    def begin_warm_start(self, config: WarmStartConfig) -> torch.optim.Optimizer:
        """The warm start's optimizer (its own AdamW state, dropped by `start_rl`). When it
        trains every weight of a [lora] policy (`WarmStartConfig.trains_all`), the policy is
        first rebuilt without adapters exactly as full training builds it (same seed, fp32
        master weights under mixed precision), so the warm start is full training's."""
        hf = self.model_config.hf_checkpoint
        if self.lora.enabled and config.trains_all(lora=True, hf_checkpoint=hf):
            if not self.training_base:
                self._adopt(self._build(adapters=False))
                self.training_base = True
        return self._adamw(config.lr)

    def start_rl(self) -> bool:
        """The warm start is over. A [lora] policy whose warm start trained every weight gets
        fresh adapters (as drawn at the start) on what it learnt, that base frozen in
        training.dtype from here on. Then the KL reference becomes the policy as RL starts
        (unless it was loaded from loss.kl_reference). Returns whether the base changed
        (generators that keep a base need the new one)."""
        changed = self.training_base
        if changed:
            trained, model = self.model, self._build(adapters=True)
            _copy_parameters(model, trained)  # the base, under the same names
            self._adopt(model)
            self.training_base, self.base_warm_started = False, True
            self.base = self.base_record(warm_started=True)
        if self.reference is not None and not self.reference.from_hf:
            self.reference.copy_from(self.model)
        return changed

    def _build(self, *, adapters: bool) -> PolicyModel:
        """A sharded policy model as `__init__` builds it (seed `self.seed`; the global RNG
        is left as it was). With `adapters` its base is a random init for the caller to
        overwrite (no Hugging Face folder is read again)."""
        config = self.model_config
        if adapters:
            config = dataclasses.replace(config, hf_checkpoint="")
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            model = build_model(config, self.vocab_size, self.device)
        if adapters:
            self._add_adapters(model)
        self._shard(model)
        return model

    def _adopt(self, model: PolicyModel) -> None:
        """`model` becomes the policy, with a fresh RL optimizer and schedule over what it
        trains (RL has not started when the policy is rebuilt)."""
        if self.training.compile:
            apply_compile(model)
        self.model = model
        self.optimizer = self._adamw(self.training.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.training.lr_factor)

    def _adamw(self, lr: float) -> torch.optim.Optimizer:
        # One fused kernel over all parameters on GPU. On CPU the foreach implementation
        # (same arithmetic, bit for bit) dispatches each op once per parameter list, not once
        # per parameter, and the default picks the per-parameter loop there.
        cuda = self.device.type == "cuda"
        return torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # [lora]: adapters only
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
        if mb.branch_ids_RS is not None:
            out["branch_ids_BS"] = to(mb.branch_ids_RS, torch.long)
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
            t.get("branch_ids_BS"),
        )

    # ---- steps ------------------------------------------------------------------------
    def train_step(self, updates: list[list[Microbatch]], temperature: float) -> dict[str, float]:
        """One RL step: an optimizer step per entry of `updates` (this rank's microbatches
        of each minibatch); returns the step's metrics, reduced over microbatches, ranks
        and updates by each metric's own reduction."""
        self.model.train()
        tensors = [[self._tensors(mb) for mb in microbatches] for microbatches in updates]
        old, timer = None, _StageTimer(self.device)
        if self.loss_config.old_logprobs == "recompute":
            with timer:
                old = self._old_logprobs(tensors, temperature)
        parts = []
        for i, microbatches in enumerate(updates):
            old_i = old[i] if old is not None else [None] * len(microbatches)
            parts.append(self._update(microbatches, tensors[i], old_i, temperature))
        out = results(merge(parts))
        if old is not None:  # read after the updates synced the device: no extra sync
            out["perf/old_logprobs_seconds"] = timer.seconds()
        return out

    @torch.no_grad()
    def _old_logprobs(self, tensors: list[list[dict]], temperature: float) -> list[list]:
        """pi_old of every loss token of the step, before any update changes the weights.
        In eval mode: [lora] dropout off, so pi_old is the policy the generator sampled from
        (its merged weights have no dropout), not a random draw of it."""
        self.model.eval()
        try:
            with held_gathered(self.model):  # one all-gather on CPU
                return [[self._logprobs(t, temperature)[0] for t in update] for update in tensors]
        finally:
            self.model.train()

    def _update(self, microbatches, tensors, old, temperature: float) -> Metrics:
        parts = []
        with held_gathered(self.model):  # one all-gather per update on CPU
            for mb, t, old_N in zip(microbatches, tensors, old):
                parts.append(self._microbatch(mb, t, old_N, temperature))
        metrics = self._all_ranks(merge(_on_host(parts)))
        loss = metrics["loss/mean"].result() if "loss/mean" in metrics else 0.0
        lr = self.optimizer.param_groups[0]["lr"]  # this update's; the scheduler moves on
        applied, opt_metrics = self._optimizer_step(self.optimizer, loss)
        if applied:  # a skipped step leaves the learning-rate schedule where it was
            self.scheduler.step()
        return {**metrics, **opt_metrics, "trainer/lr": Metric.last(lr)}

    def _microbatch(self, mb: Microbatch, t: dict, old_N, temperature: float) -> Metrics:
        """Forward and backward of one microbatch; its metrics (tensors, not yet synced)."""
        ref_N = self._reference_logprobs(t, temperature)
        logprobs_N, entropy_N = self._logprobs(t, temperature)
        loss, metrics = microbatch_objective(
            logprobs_N,
            old_N,
            t["generator_logprobs_N"],
            t["advantages_N"],
            t["sequence_ids_N"],
            loss=self.loss_config,
            correction=self.correction,
            num_global_tokens=mb.num_global_loss_tokens,
            num_global_sequences=mb.num_global_sequences,
            entropy_N=entropy_N,
            ref_logprobs_N=ref_N,
        )
        loss.backward()
        n = float(t["targets_N"].numel())
        metrics["trainer/loss_tokens"] = Metric.sum(n)
        if mb.support_offsets is not None:  # sampling-mask replay: ids kept per token
            kept = float(np.diff(mb.support_offsets.astype(np.int64)).sum())
            metrics["trainer/kept_vocab_per_token"] = Metric.mean(kept, n)
        return metrics

    @torch.no_grad()
    def _reference_logprobs(self, t: dict, temperature: float) -> torch.Tensor | None:
        """The KL reference's log-probs (None without KL): the reference model's, or with
        `loss.kl_reference = "base"` the base's, i.e. this model with adapters disabled."""
        if self.base_reference:
            with lora_lib.adapters_disabled(self.model):
                return self._logprobs(t, temperature)[0]
        return self.reference.logprobs(t, temperature) if self.reference is not None else None

    def _all_ranks(self, metrics: Metrics) -> Metrics:
        """This update's metrics over the data-parallel ranks (ranks may differ in which
        keys they saw: an all-padding microbatch reports none, so gather whole dicts)."""
        if not self.distributed:
            return metrics
        parts = [None] * dist.get_world_size(self.dp_group)
        dist.all_gather_object(parts, metrics, group=self.dp_group)
        return merge(parts)

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
        loss = float(total)
        _, metrics = self._optimizer_step(optimizer, loss)
        # under warm_start/: its steps (logged at <= 0) stay off the RL curves' charts
        out = results(metrics)
        return {
            "warm_start/loss": loss,
            "warm_start/grad_norm": out["trainer/grad_norm"],
            "warm_start/skipped_steps": out["trainer/skipped_steps"],
        }

    def _optimizer_step(self, optimizer, loss: float) -> tuple[bool, Metrics]:
        """Clip and step, unless the gradient or loss is not finite; (applied, metrics)."""
        clip = self.training.max_grad_norm if self.training.max_grad_norm > 0 else float("inf")
        norm = float(clip_grad_norm(self.model.parameters(), clip))
        applied = math.isfinite(norm) and math.isfinite(loss)
        if applied:
            optimizer.step()
            self.policy_version += 1
        else:
            self.skipped_steps += 1  # never apply a non-finite update
        optimizer.zero_grad(set_to_none=True)
        return applied, {
            "trainer/grad_norm": Metric.mean(norm, 1.0),
            "trainer/skipped_steps": Metric.last(float(self.skipped_steps)),
            "trainer/policy_version": Metric.last(float(self.policy_version)),
        }

    # ---- weights ----------------------------------------------------------------------
    def full_state_dict(self, *, merged: bool = True) -> dict[str, torch.Tensor]:
        """Full (unsharded) fp32 CPU weights under the generator's names; a collective:
        every rank must call it. With [lora] on: the merged weights, or with
        `merged=False` the base with its adapters (the state dict as it is)."""
        if self.distributed:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(self.model, options=options)
        else:
            state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        state = {k: v.float() for k, v in state.items()}
        if self.lora.enabled and merged:
            return lora_lib.merged_full_state(state, self.lora.scale)
        return state

    def sync_state(self, *, merge: bool = True) -> dict[str, torch.Tensor]:
        """What a weight sync packs: `packing.sharded_state`, with [lora] on the merged
        weights (models/lora.py `merged_state`): then a collective under FSDP/TP (each
        merge gathers its A). `merge=False`: the same names, shapes and layout with the
        base weights in place of the merges, and no communication (for a layout only)."""
        state = sharded_state(self.model)
        if not self.lora.enabled:
            return state
        if not merge:
            return {k: v for k, v in state.items() if not lora_lib.is_adapter(k)}
        return lora_lib.merged_state(self.model, state)

    def adapters(self) -> lora_lib.Adapters:
        """The adapters alone at the current policy version (an adapter-only sync, the
        PEFT export); a collective under FSDP/TP."""
        assert self.lora.enabled, "lora.rank is 0"
        return lora_lib.adapter_weights(self.model, self.lora, self.policy_version)

    @torch.no_grad()
    def logprobs(self, mb: Microbatch, temperature: float = 1.0) -> np.ndarray:
        """Trainer log-probs of mb's loss tokens (row-major), for checks and diagnostics."""
        self.model.eval()
        with held_gathered(self.model):
            logprobs_N, _ = self._logprobs(self._tensors(mb), temperature)
        return logprobs_N.float().cpu().numpy()


class _StageTimer:
    """Wall time of a block of device work, without a host sync inside the step: CUDA
    events on a GPU (read once the step has synced anyway), the host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._start = self._end = None

    def __enter__(self):
        if self.cuda:
            self._start, self._end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._end.record()
        else:
            self._end = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            return self._start.elapsed_time(self._end) / 1e3
        return self._end - self._start


@torch.no_grad()
def _copy_parameters(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """Every parameter of `src` into `dst`'s parameter of the same name (same sharding:
    shards copied in place, cast to `dst`'s dtype; on one rank a frozen base is plain)."""
    own = dict(dst.named_parameters())
    for name, param in src.named_parameters():
        copy_param_(own[name], param.detach())


def _on_host(parts: list[Metrics]) -> list[Metrics]:
    """The same metrics with every tensor value moved to a float, in one device sync."""
    tensors = [
        v.detach().double().reshape(())
        for part in parts
        for m in part.values()
        for v in (m.value, m.count)
        if isinstance(v, torch.Tensor)
    ]
    host = iter(torch.stack(tensors).tolist() if tensors else [])

    def number(v) -> float:
        return next(host) if isinstance(v, torch.Tensor) else float(v)

    return [
        {k: Metric(m.reduce, number(m.value), number(m.count)) for k, m in part.items()}
        for part in parts
    ]
