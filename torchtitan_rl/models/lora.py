"""LoRA adapters on torchtitan's Qwen3: train two small matrices per projection, keep the
base frozen.

A targeted projection `y = x W^T` (W [out, in]) becomes

    y = x W^T + scale * dropout(x) A^T B^T      A [rank, in], B [out, rank], scale = alpha / rank

A starts Kaiming-uniform (as PEFT does), B at zero, so step 0 is the base policy. The base
weight keeps its name (`layers.0.attention.wq.weight`); the adapters sit next to it
(`layers.0.attention.wq.lora_A`, `...lora_B`), so checkpoints of the base, the Hugging Face
import and the generator's names are unchanged. What leaves the trainer for a generator or
an export is the merged weight W + scale * B @ A (`merged_state`), or the adapters alone
(`adapter_weights`, for an adapter-only sync and the PEFT export in `models/peft_export.py`).

Tensor parallelism: a column-parallel W (Shard(0), output features split) gets A
replicated and B split like W; a row-parallel W (Shard(1), input features split) gets A
split like W and B replicated (`place_adapters`). The LoRA path then yields the same
layout as the base path (Shard(-1) or Partial), and DTensor adds them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from torchtitan_rl.checks import check_range
from torchtitan_rl.models.model_config import ModelConfig

TARGETS = {
    "q_proj": ("attention.wq", "self_attn"),
    "k_proj": ("attention.wk", "self_attn"),
    "v_proj": ("attention.wv", "self_attn"),
    "o_proj": ("attention.wo", "self_attn"),
    "gate_proj": ("feed_forward.w1", "mlp"),
    "up_proj": ("feed_forward.w3", "mlp"),
    "down_proj": ("feed_forward.w2", "mlp"),
}
"""Hugging Face / PEFT projection name -> (torchtitan module under a block, HF parent)."""
VllmSync = Literal["merged", "adapters"]
VLLM_SYNCS = get_args(VllmSync)
GeneratorBase = Literal["auto", "device", "host"]
GENERATOR_BASES = get_args(GeneratorBase)

SCALE = "lora.scale"
"""The layout name of the adapter scale (alpha / rank) in an adapter-only weight sync's
payload (weight_sync/lora_sync.py), as engines read it."""


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """TOML section [lora]: train low-rank adapters instead of every weight."""

    rank: int = 0
    """Adapter rank r, >= 0; 0 (the default) trains every weight, r > 0 only the adapters."""
    alpha: float = 8.0
    """Scale numerator, finite and > 0: the adapter output is multiplied by alpha / rank.
    8 is PEFT's default `lora_alpha`, so `--lora.rank=8` alone gives scale 1 as PEFT's
    defaults do; keep alpha fixed while changing the rank to keep PEFT's scaling."""
    target_modules: list[str] = field(default_factory=lambda: list(TARGETS))
    """Projections that get adapters, by their Hugging Face / PEFT names: any of q_proj,
    k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (default: all seven; adapters on
    the MLP as well as attention, as "LoRA Without Regret" recommends)."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training, in [0, 1) (PEFT's `lora_dropout`)."""
    vllm_sync: VllmSync = "merged"
    """How a generator.backend = "vllm" generator gets each version: "merged" (the merged
    full weights, reloaded in place: the same kernels as without LoRA) | "adapters" (vLLM
    built with LoRA; the base once, then each version's adapters alone, served as a new
    LoRA adapter per version; on a GPU with generator.dtype = "bfloat16" only: vLLM's GPU
    LoRA kernels take 16-bit inputs; docs/design.md, "LoRA"). The native engine always takes
    adapters and merges them itself."""
    generator_base: GeneratorBase = "auto"
    """Where a native generator keeps the frozen base of the adapted weights, which it
    merges each version's adapters into: "device" (in its device's memory for the run: the
    adapted weights once more, in the trainer's dtype; nothing moves per sync) | "host"
    (page-locked host memory; each sync copies it to the GPU weight by weight as it merges:
    7.3 GB at the 4B shape, 13.9 GB at 8B) | "auto" (device when it fits the generator's
    GPU memory with room to spare, else host: weight_sync/lora_sync.py
    `base_fits_on_device`). On CPU both are host memory: "device" and "auto" keep only the
    adapted weights' base, "host" the whole base as received."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        check_range("lora.rank", self.rank, ge=0)
        check_range("lora.alpha", self.alpha, gt=0)
        check_range("lora.dropout", self.dropout, ge=0, lt=1)
        if self.vllm_sync not in VLLM_SYNCS:
            raise ValueError(f"lora.vllm_sync must be one of {VLLM_SYNCS}, got {self.vllm_sync!r}")
        if self.generator_base not in GENERATOR_BASES:
            raise ValueError(
                f"lora.generator_base must be one of {GENERATOR_BASES}, got {self.generator_base!r}"
            )
        bad = [t for t in self.target_modules if t not in TARGETS]
        if (
            bad
            or not self.target_modules
            or len(set(self.target_modules)) < len(self.target_modules)
        ):
            raise ValueError(
                f"lora.target_modules must be a non-empty list of distinct names from "
                f"{list(TARGETS)}, got {self.target_modules!r}"
            )


def base_record(
    model: ModelConfig, seed: int, lora: LoRAConfig, *, vocab_size: int, dtype: str,
    device: str, warm_started: bool = False,
) -> str:  # fmt: skip
    """The base a LoRA checkpoint needs, as JSON: the Hugging Face folder, or what the
    random init depends on (flavor, seed, vocabulary size, the device type it was drawn on);
    the dtype the base is frozen in; plus the adapter shape (rank, alpha, targets).
    `warm_started`: the warm start trained that base (`warm_start.params = "all"`), so the
    checkpoint holds it ("warm_started": true)."""
    base = {"hf_checkpoint": model.hf_checkpoint} if model.hf_checkpoint else {}
    if not base:
        base = {"flavor": model.flavor, "seed": seed, "vocab_size": vocab_size, "device": device}
    base["dtype"] = dtype
    if warm_started:
        base["warm_started"] = True
    shape = {"rank": lora.rank, "alpha": lora.alpha, "targets": sorted(lora.target_modules)}
    return json.dumps({**base, **shape}, sort_keys=True)


class LoRALinear(nn.Linear):
    """A bias-free Linear whose weight is frozen and whose output adds scale * B(A(x))."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float):
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate a second weight
        assert base.bias is None, "Qwen3 projections have no bias"
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", None)
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.zeros(rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device))
        self.scale = scale
        self.dropout = dropout
        self.adapters_enabled = True
        """False inside `adapters_disabled`: the base model's forward (the KL reference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapters_enabled:
            return F.linear(x, self.weight)
        w, a, b = self.weight, self.lora_A, self.lora_B
        # under FSDP mixed precision every gathered parameter is in the compute dtype already
        if a.dtype != x.dtype:
            a, b = a.to(x.dtype), b.to(x.dtype)
        dropout = self.dropout and self.training
        if dropout or isinstance(w, DTensor):
            # dropout: the adapter sees another input; TP: DTensor ops lay the sum out
            xa = F.dropout(x, self.dropout) if dropout else x
            return F.linear(x, w) + self.scale * F.linear(F.linear(xa, a), b)
        return LoRAProjection.apply(x, w, a, b, self.scale)


class LoRAProjection(torch.autograd.Function):
    """y = x W^T + scale * (x A^T) B^T as one autograd node of few kernels (plain tensors).

    Written out, the adapted projection is 5 kernels forward and 7 backward, each behind a
    Python op and an autograd node (`tests/test_lora_speed.py` counts them); a trainer step
    of a small model on a GPU is bound by that overhead (docs/benchmarks.md, "LoRA against
    full training on one GPU"). Here the scale and the sum ride in the GEMMs' epilogues
    (addmm's alpha and beta): forward x W^T, h = x A^T, y += scale h B^T (3 GEMMs); backward
    gB = g B, dx = g W + scale gB A, dA = scale gB^T x, dB = scale g^T h (5 GEMMs).
    Each sum and scale is applied to an fp32 accumulator and rounded once, where the
    written-out form rounds B's product, its scaling and the sum one by one in bf16."""

    @staticmethod
    def forward(ctx, x, w, a, b, scale: float):
        x_TD = x.reshape(-1, x.shape[-1])
        h_TR = torch.mm(x_TD, a.t())
        y_TO = torch.mm(x_TD, w.t())
        y_TO.addmm_(h_TR, b.t(), alpha=scale)
        ctx.save_for_backward(x_TD, w, a, b, h_TR)
        ctx.scale, ctx.x_shape = scale, x.shape
        return y_TO.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x_TD, w, a, b, h_TR = ctx.saved_tensors
        s, need = ctx.scale, ctx.needs_input_grad
        g_TO = grad.reshape(-1, grad.shape[-1])
        gb_TR = torch.mm(g_TO, b) if need[0] or need[2] else None
        dx = dw = da = db = None
        if need[0]:
            dx = torch.mm(g_TO, w).addmm_(gb_TR, a, alpha=s).view(ctx.x_shape)
        if need[1]:
            dw = torch.mm(g_TO.t(), x_TD)
        # beta=0: the first argument only gives the shape (BLAS ignores it; a and b are
        # finite, so a decomposition that computes 0 * it adds zeros)
        if need[2]:
            da = torch.addmm(a, gb_TR.t(), x_TD, beta=0, alpha=s)
        if need[3]:
            db = torch.addmm(b, g_TO.t(), h_TR, beta=0, alpha=s)
        return dx, dw, da, db, None


def add_adapters(
    model: nn.Module, config: LoRAConfig, *, seed: int, base_dtype: torch.dtype
) -> None:
    """Wrap the targeted projections of every block, freeze everything else, cast the frozen
    base to `base_dtype` (the training compute dtype). Call before sharding.

    A is drawn from its own generator seeded by `seed` and the layer, so every rank, every
    sharding and a resumed run get the same adapters (the global RNG is not touched)."""
    model.requires_grad_(False)
    with torch.no_grad():  # parameters only: buffers (the RoPE cache) keep their dtype
        for p in model.parameters():
            p.data = p.data.to(base_dtype)
    for i, block in model.layers.items():
        for hf_name in config.target_modules:
            parent_name, _, leaf = TARGETS[hf_name][0].rpartition(".")
            parent = block.get_submodule(parent_name)
            lora = LoRALinear(getattr(parent, leaf), config.rank, config.scale, config.dropout)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + int(i) * 31 + _index(hf_name))
            with torch.no_grad():  # PEFT's init: kaiming_uniform_(a=sqrt(5)) on A
                bound = 1 / math.sqrt(lora.in_features)
                a = torch.rand(lora.lora_A.shape, generator=gen, dtype=torch.float64)
                lora.lora_A.copy_((2 * a - 1) * bound)
            setattr(parent, leaf, lora)


def _index(hf_name: str) -> int:
    return list(TARGETS).index(hf_name)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(fully qualified name, module) of every adapted projection."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def is_adapter(name: str) -> bool:
    """Whether a state-dict key names an adapter parameter."""
    return name.endswith((".lora_A", ".lora_B"))


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model's forward inside the block: same weights, adapters skipped."""
    modules = [m for _, m in lora_modules(model)]
    for m in modules:
        m.adapters_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.adapters_enabled = True


def place_adapters(model: nn.Module) -> None:
    """After tensor parallelism sharded the base weights: lay the adapters out to match
    (module docstring). ColwiseParallel shards every parameter of a Linear on dim 0, which
    for A would split the rank; RowwiseParallel leaves them plain. Both are replaced.

    The plan also re-creates parameters without their `requires_grad` (SequenceParallel's
    norms; our vocab-sharded head), so the base is frozen again here."""
    modules = list(lora_modules(model))
    if modules:
        for name, p in model.named_parameters():
            p.requires_grad_(is_adapter(name))
    for _, m in modules:
        w = m.weight
        if not isinstance(w, DTensor):
            continue
        (placement,) = w.placements
        col = isinstance(placement, Shard) and placement.dim == 0
        for name, shard_dim in (("lora_A", None if col else 1), ("lora_B", 0 if col else None)):
            p = getattr(m, name)
            full = p.full_tensor() if isinstance(p, DTensor) else p
            layout = [Shard(shard_dim) if shard_dim is not None else Replicate()]
            dt = distribute_tensor(full.detach(), w.device_mesh, layout)
            setattr(m, name, nn.Parameter(dt, requires_grad=p.requires_grad))


@torch.no_grad()
def merged_weight(m: LoRALinear) -> torch.Tensor:
    """W + scale * B @ A in fp32, laid out as W (this rank's shard of it under FSDP).

    FSDP (rows of W and B split alike over a 1-D mesh): each rank merges its own rows with
    the gathered A (rank x in, small). Other layouts (TP, TP + FSDP) merge full tensors
    (every rank the same), which the packing then takes as whole tensors."""
    w, a, b = m.weight, m.lora_A, m.lora_B
    if not isinstance(w, DTensor):  # no FSDP, or one rank (the base outside FSDP)
        a, b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (a, b))
        return w.float() + m.scale * (b.float() @ a.float())
    rows = w.device_mesh.ndim == 1 and w.placements == (Shard(0),) == b.placements
    if rows:
        a_full = a.full_tensor().float()
        local = w.to_local().float() + m.scale * (b.to_local().float() @ a_full)
        return DTensor.from_local(local, w.device_mesh, w.placements, shape=w.shape,
                                  stride=w.stride(), run_check=False)  # fmt: skip
    return w.full_tensor().float() + m.scale * (b.full_tensor().float() @ a.full_tensor().float())


def merged_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the model's sharded or full state dict) with every adapted weight replaced
    by its merge and the adapter entries dropped: the generator's names and shapes.

    Memory: one fp32 copy of this rank's adapted weights while the result lives (a sync,
    an export); the adapter-only sync will not need it."""
    merged = {f"{name}.weight": merged_weight(m) for name, m in lora_modules(model)}
    return {k: merged.get(k, v) for k, v in state.items() if not is_adapter(k)}


def merged_full_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A full (unsharded) state dict with adapters -> the merged weights, adapters dropped
    (fp32: W + scale * B @ A under each adapted weight's name)."""
    out = {}
    for k, v in state.items():
        if is_adapter(k):
            continue
        prefix = k.removesuffix(".weight")
        if f"{prefix}.lora_A" in state:
            a, b = state[f"{prefix}.lora_A"].float(), state[f"{prefix}.lora_B"].float()
            v = v.float() + scale * (b @ a)
        out[k] = v
    return out


@dataclass(kw_only=True, slots=True)
class Adapters:
    """The adapters alone, as an adapter-only weight sync or an export needs them:

        tensors = {"model.layers.0.self_attn.q_proj": (A [rank, in], B [out, rank]), ...}
        scale = alpha / rank; the merged weight is W + scale * B @ A
        version = the policy version these adapters belong to

    Names are the Hugging Face module names of the base (PEFT prefixes them with
    "base_model.model." and suffixes ".lora_A.weight" / ".lora_B.weight")."""

    version: int
    rank: int
    alpha: float
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def hf_module_name(name: str) -> str:
    """torchtitan module name -> Hugging Face: "layers.3.attention.wq" ->
    "model.layers.3.self_attn.q_proj"."""
    _, layer, rest = name.split(".", 2)
    hf = next(k for k, (tt, _) in TARGETS.items() if tt == rest)
    return f"model.layers.{layer}.{TARGETS[hf][1]}.{hf}"


@torch.no_grad()
def adapter_weights(model: nn.Module, config: LoRAConfig, version: int) -> Adapters:
    """Full (unsharded) fp32 CPU adapters of every adapted projection; a collective under
    FSDP / TP (every rank calls it, in the same order)."""

    def full(p: torch.Tensor) -> torch.Tensor:
        return (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()

    tensors = {
        hf_module_name(name): (full(m.lora_A), full(m.lora_B)) for name, m in lora_modules(model)
    }
    return Adapters(version=version, rank=config.rank, alpha=config.alpha, tensors=tensors)
