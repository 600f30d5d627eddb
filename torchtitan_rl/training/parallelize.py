"""Process group, device mesh, FSDP2 and tensor parallelism for the trainer, on CPU (gloo)
and GPU (NCCL)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan_rl.models.lora import place_adapters
from torchtitan_rl.models.qwen3 import PolicyModel


def apply_fsdp(model: PolicyModel, device: torch.device, param_dtype: torch.dtype) -> None:
    """Shard the model over all trainer ranks with torchtitan's Qwen3 parallelize function.

    Tied embeddings (the real Qwen3 0.6B-4B) cannot sit in two FSDP groups, so for them the
    embedding, final norm and head share the root group and each block is its own group.
    The same grouping serves a single rank, which torchtitan would leave unwrapped (and so
    without the mixed-precision policy). On a single rank the frozen weights already in
    `param_dtype` stay plain tensors outside FSDP (`frozen_outside_fsdp`).
    On CPU the gathered weights outlive the forward (see `held_gathered`).
    """
    world = dist.get_world_size()
    reshard = device.type != "cpu"
    if model.model_args.enable_weight_tying or world == 1:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
        ignored = frozen_outside_fsdp(model, param_dtype) if world == 1 else None
        _shard_blocks_and_root(model, mesh, param_dtype, reshard, ignored)
    else:
        _torchtitan_parallelize(model, device, world, param_dtype, reshard)
    _sum_gradients(model, device)


def apply_tp_fsdp(
    model: PolicyModel, device: torch.device, param_dtype: torch.dtype, tp: int
) -> DeviceMesh:
    """Tensor parallelism over groups of `tp` consecutive ranks, FSDP across the groups.

    Returns the 2-D mesh ("dp", "tp"): world = dp * tp and rank r sits at (r // tp, r % tp),
    so the ranks of one TP group must get the same microbatches (see TrainerCore.dp_rank).
    """
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"parallelism.tp={tp} must divide trainer_procs={world}")
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    apply_tp(model, mesh["tp"])
    _shard_blocks_and_root(model, mesh["dp"], param_dtype, device.type != "cpu")
    _sum_gradients(model, device)
    return mesh


def apply_tp(model: PolicyModel, tp_mesh: DeviceMesh) -> None:
    """torchtitan's Qwen3 TP plan (`apply_non_moe_tp`: vocab-sharded embedding, sequence-
    parallel norms, column/row-parallel attention and MLP), adapted to this model:

    - positions: ours are per-document, so they enter attention as a Replicate DTensor, as
      torchtitan passes them under context parallelism (the one thing `cp_enabled=True`
      changes in that function);
    - FlexAttention has no DTensor rule: q, k, v enter it as this rank's local heads and its
      output leaves as a DTensor sharded on heads;
    - the LM head: torchtitan's plan makes `output` a column-parallel logits layer, ours is
      `LogProbHead`, so the plan gets a throwaway stand-in and the head's weight is sharded
      by vocabulary rows (Shard(0)), which LogProbHead turns into vocab-parallel log-probs.
      That is the embedding's layout too, so a tied weight stays one parameter;
    - LoRA adapters (models/lora.py) follow their projection's layout (`place_adapters`).
    """
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module
    from torchtitan.models.qwen3.infra.parallelize import apply_non_moe_tp

    args, tp = model.model_args, tp_mesh.size()
    if args.n_heads % tp or args.n_kv_heads % tp:
        raise ValueError(
            f"parallelism.tp={tp} must divide n_heads={args.n_heads} and "
            f"n_kv_heads={args.n_kv_heads} of the model"
        )
    head = model.output
    model.output = nn.Linear(args.dim, tp, bias=False, device=head.weight.device)
    apply_non_moe_tp(
        model, tp_mesh, loss_parallel=False, enable_float8_tensorwise_tp=False,
        enable_async_tp=False, cp_enabled=True,
    )  # fmt: skip
    model.output = head
    local_heads = PrepareModuleInputOutput(
        input_layouts=(Shard(1), Shard(1), Shard(1)),
        desired_input_layouts=(Shard(1), Shard(1), Shard(1)),
        use_local_input=True,
        output_layouts=Shard(1),
        desired_output_layouts=Shard(1),
        use_local_output=False,
    )
    for block in model.layers.values():
        parallelize_module(block.attention.inner_attention, tp_mesh, local_heads)
    if args.enable_weight_tying:
        head.weight = model.tok_embeddings.weight
    else:
        head.weight = nn.Parameter(distribute_tensor(head.weight.detach(), tp_mesh, [Shard(0)]))
    place_adapters(model)  # [lora]: adapters laid out like their base weight, base frozen


def apply_compile(model: PolicyModel, backend: str = "inductor") -> None:
    """torch.compile each transformer block, as torchtitan does: one full graph per block,
    shared by all blocks (parameters are graph inputs, so 28 blocks compile once).

    Only `forward` is replaced, in place, so parameter names (checkpoints, weight sync, the
    Hugging Face export) stay as they are and FSDP's hooks, which run around `forward`, stay
    eager. The document mask enters each block as an input: its tensors change with every
    batch but keep their shapes (the batcher pads every microbatch to [R, S]), so a new batch
    reuses the graph; eval under no_grad compiles a second one. `backend`: tests trace with
    "aot_eager" to check graph capture without generating kernels.
    """
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)


@contextmanager
def held_gathered(model: PolicyModel) -> Iterator[None]:
    """CPU FSDP: each group's weights are all-gathered once, at its first forward inside the
    block, held through every microbatch's forward and backward, and freed on exit.

    Each gloo all-gather costs milliseconds and makes the ranks wait for each other; with
    `apply_fsdp` leaving blocks gathered after forward on CPU, a step of M microbatches
    makes one all-gather per group instead of 2 * M. The weights
    do not change inside the block and gradients are still reduce-scattered after every
    backward, so the numbers are the same. The weights are freed on exit, before the
    optimizer changes the shards, so the next gather sees the update. Elsewhere (GPU, or
    no FSDP) a no-op: there holding a large model's weights would defeat sharding.
    """
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    held = bool(groups) and next(model.parameters()).device.type == "cpu"
    if held:
        model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        if held:
            for module in groups:
                module.reshard()
            model.set_reshard_after_backward(True)


def frozen_outside_fsdp(model: nn.Module, param_dtype: torch.dtype) -> set[nn.Parameter]:
    """One rank: the parameters FSDP leaves alone, those frozen already in `param_dtype`
    (the [lora] base, a KL reference). FSDP on one rank shards nothing, and its unshard
    copies each parameter into a buffer of its own, one copy per parameter at every unshard
    (torch 2.13's world-size-1 path): for a frozen weight in the compute dtype the copy is
    the weight itself, so the forward reads the weight instead. Same values, same numbers."""
    return {p for p in model.parameters() if not p.requires_grad and p.dtype == param_dtype}


def copy_param_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` across FSDP's one-rank layouts: a DTensor into a plain tensor (one
    left outside FSDP, `frozen_outside_fsdp`) copies its full value."""
    if isinstance(src, DTensor) and not isinstance(dst, DTensor):
        src = src.full_tensor()
    dst.copy_(src)


def _shard_blocks_and_root(
    model: PolicyModel, mesh: DeviceMesh, param_dtype, reshard, ignored=None
) -> None:
    """One FSDP group per block, the embedding, final norm and head in the root group;
    `reshard`: free each block's gathered weights after its forward (False on CPU);
    `ignored`: parameters left as plain tensors outside FSDP; when there are none,
    `fully_shard` gets no `ignored_params` (an empty set is another call: FSDP then drops
    the modules without parameters, attention's, from the modules it marks for Dynamo)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    ignored = ignored or None
    for block in model.layers.values():
        fully_shard(
            block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=ignored)


def _sum_gradients(model: PolicyModel, device: torch.device) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is already normalised by the global token count: sum, never average.
            module.set_gradient_divide_factor(1.0)
            if device.type == "cpu":
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _torchtitan_parallelize(model, device, world, param_dtype, reshard) -> None:
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import parallel_dims as parallel_dims_module
    from torchtitan.models.qwen3 import parallelize_qwen3

    # torchtitan 0.2.2 assumes "cuda" when no accelerator exists; this trainer process is
    # the only user of the module, so point it at the device we actually run on.
    parallel_dims_module.device_type = device.type
    dims = ParallelDims(
        dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world
    )
    dims.build_mesh()
    job = JobConfig()
    job.training.seq_len = model.model_args.max_seq_len
    job.training.mixed_precision_param = "bfloat16" if param_dtype == torch.bfloat16 else "float32"
    job.training.mixed_precision_reduce = "float32"
    job.activation_checkpoint.mode = "none"
    job.parallelism.fsdp_reshard_after_forward = "default" if reshard else "never"
    job.compile.enable = False
    parallelize_qwen3(model, dims, job)
