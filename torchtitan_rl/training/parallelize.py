"""Process group, device mesh and FSDP2 for the trainer, on CPU (gloo) and GPU (NCCL)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from torchtitan_rl.models.qwen3 import PolicyModel


def pick_device(kind: str, cpu_threads: int = 0) -> torch.device:
    """The device for this process: its local GPU under "cuda"/"auto" when present, else CPU
    (then torch uses `cpu_threads` threads in this process, when given)."""
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("parallelism.device: 'cuda' asked for, but no CUDA device is visible")
    local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def init_process_group(device: torch.device) -> tuple[int, int]:
    """Join the trainer's process group (env set by Monarch's elastic setup); (rank, world)."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def apply_fsdp(model: PolicyModel, device: torch.device, param_dtype: torch.dtype) -> None:
    """Shard the model over all trainer ranks with torchtitan's Qwen3 parallelize function.

    Tied embeddings (the real Qwen3 0.6B-4B) cannot sit in two FSDP groups, so for them the
    embedding, final norm and head share the root group and each block is its own group.
    The same grouping serves a single rank, which torchtitan would leave unwrapped (and so
    without the mixed-precision policy).
    """
    world = dist.get_world_size()
    if model.model_args.enable_weight_tying or world == 1:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    else:
        _torchtitan_parallelize(model, device, world, param_dtype)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is already normalised by the global token count: sum, never average.
            module.set_gradient_divide_factor(1.0)
            if device.type == "cpu":
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _torchtitan_parallelize(model, device, world, param_dtype) -> None:
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
    job.compile.enable = False
    parallelize_qwen3(model, dims, job)
