"""Generator tensor parallelism: sharded weights by plain slicing, decisions from rank 0.

Sharding (Megatron style, per transformer block): attention `wq`/`wk`/`wv` keep this rank's
contiguous slice of heads (rows), `wo` the matching input columns; feed-forward `w1`/`w3`
keep a slice of hidden units (rows), `w2` the matching columns. Embeddings, norms and the
output head stay whole. Each rank's partial `wo` and `w2` outputs are summed with one
all-reduce each, so every rank holds the full hidden state after every block.

Lockstep: rank 0 runs the `Engine` (queue, scheduler, sampling) and broadcasts each
`Action` before executing it; every other rank runs `run_follower`, which receives the
same actions and runs the same forwards, so the collectives inside them pair up. Only
rank 0 samples; the sampled tokens reach the followers inside the next STEP's inputs.

Works over any torch.distributed backend (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import queue
import re

import torch
import torch.distributed as dist
from torchtitan.models.qwen3 import Qwen3Model

from torchtitan_rl.generation.engine import Action, ActionKind, EngineConfig, build_runner

ROW_SHARDED = re.compile(r"layers\.\d+\.(attention\.w[qkv]|feed_forward\.w[13])\.weight")
COL_SHARDED = re.compile(r"layers\.\d+\.(attention\.wo|feed_forward\.w2)\.weight")


class TensorParallel:
    """This rank's view of a generator TP group (an initialised process group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not None else 0

    def shard_model(self, model: Qwen3Model) -> None:
        """Replaces each sharded weight of `model` by this rank's slice, in place."""
        args = model.model_args
        n_kv = args.n_kv_heads or args.n_heads
        if args.moe_enabled:
            raise ValueError("generator tensor parallelism supports dense Qwen3 only")
        for name, size in (("n_kv_heads", n_kv), ("hidden_dim", args.hidden_dim)):
            if size % self.world_size:
                raise ValueError(
                    f"{name}={size} must be divisible by the generator TP size {self.world_size}"
                )
        with torch.no_grad():
            for name, module in model.named_modules():
                weight_name = f"{name}.weight"
                if ROW_SHARDED.fullmatch(weight_name) or COL_SHARDED.fullmatch(weight_name):
                    module.weight = torch.nn.Parameter(
                        self._slice(weight_name, module.weight).clone(), requires_grad=False
                    )

    def shard_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of a full state dict (torchtitan names)."""
        return {name: self._slice(name, tensor) for name, tensor in state.items()}

    def all_reduce(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, group=self.group)

    def publish(self, action: Action) -> None:
        """Rank 0: sends the next decision to every rank."""
        assert self.rank == 0, "only rank 0 decides"
        dist.broadcast_object_list([action], src=self._src, group=self.group)

    def receive(self) -> Action:
        """Other ranks: waits for rank 0's next decision."""
        box: list[Action | None] = [None]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        assert box[0] is not None
        return box[0]

    def _slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if ROW_SHARDED.fullmatch(name):
            return tensor.chunk(self.world_size, dim=0)[self.rank]
        if COL_SHARDED.fullmatch(name):
            return tensor.chunk(self.world_size, dim=1)[self.rank]
        return tensor


def run_follower(
    model: Qwen3Model,
    config: EngineConfig,
    tp: TensorParallel,
    weights: queue.Queue,
    device: torch.device | str = "cpu",
) -> None:
    """Executes rank 0's actions on this rank until CLOSE.

    `weights` receives `(state, version)` pairs (full tensors) from this rank's own
    weight transport; a PULL_WEIGHTS action applies every pair up to its version,
    waiting for them if they have not arrived yet.
    """
    config.validate()
    runner = build_runner(model, config, device, tp)
    version = 0
    while True:
        action = tp.receive()
        if action.kind == ActionKind.CLOSE:
            return
        if action.kind == ActionKind.STEP:
            assert action.batch is not None
            runner.forward(action.batch)
        elif action.kind == ActionKind.PULL_WEIGHTS:
            assert action.version is not None
            while version < action.version:
                state, version = weights.get()
                runner.load_state_dict(state)
