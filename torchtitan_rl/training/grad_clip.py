"""Gradient-norm clipping with one blocking all-reduce for FSDP's sharded gradients.

`torch.nn.utils.clip_grad_norm_` on DTensor gradients reduces the norm through DTensor's
functional collective (an asynchronous all-reduce, then `wait_tensor`). Over gloo that path
corrupted the heap under load (docs/results.md, "Measured on a 16-core host"), so for
gradients sharded over one mesh dimension the norm is reduced here instead:

    total = sqrt(all_reduce_sum(sum over local shards of ||g_local||^2))
    every gradient *= min(1, max_norm / (total + 1e-6))       (torch's rule)

Shards partition each gradient, so the ranks' sums of squares add up to the full one. Any
other layout (TP's two-dimensional mesh, replicated DTensors, plain tensors) keeps torch's
own function.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clips the gradients in place; returns the total 2-norm before clipping (a plain
    tensor, the same on every rank). A collective when the gradients are sharded."""
    params = list(params)
    trained = [p for p in params if p.requires_grad]
    # the branch follows the parameters' layout, the same on every rank (a rank without a
    # gradient must still join the all-reduce)
    if not trained or not all(_sharded_1d(p) for p in trained):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    group = trained[0].device_mesh.get_group()
    if any(p.device_mesh.get_group() != group for p in trained):
        raise ValueError("parameters sharded over different process groups")
    local = [p.grad.to_local() for p in trained if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float32, device=trained[0].to_local().device)
    if local:
        squares = torch.stack([n.float() for n in torch._foreach_norm(local, 2)]).square().sum()
    dist.all_reduce(squares, group=group)  # blocking c10d, not a functional collective
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for dtype in {g.dtype for g in local}:
        same = [g for g in local if g.dtype == dtype]
        torch._foreach_mul_(same, coef.to(dtype))
    return total


def _sharded_1d(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and t.device_mesh.ndim == 1 and isinstance(t.placements[0], Shard)
