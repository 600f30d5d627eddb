"""The cost of an adapted projection in the trainer, counted on CPU: the LoRA path runs as
one autograd node of 8 GEMMs and no elementwise kernels (3 forward, 5 backward) where the
plain projection runs 3 GEMMs, so a step of a small model on a GPU, bound by launches and
Python dispatch, does not pay 12 GEMMs, 4 elementwise kernels and a dozen autograd nodes
per projection (docs/benchmarks.md, "LoRA against full training on one GPU"). The counts
are the CPU proxy of that GPU number; the compiled blocks trace the adapters whole."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from fakes import tiny_core
from test_lora import lora_core, nonzero_b, one_rank  # noqa: F401 (a fixture)
from test_trainer import _batch, _episodes
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_rl.models.lora import TARGETS, LoRALinear, LoRAProjection
from torchtitan_rl.training.parallelize import apply_compile

METADATA = {"view", "_unsafe_view", "t", "transpose", "expand", "detach", "as_strided",
            "alias", "reshape", "slice", "select", "squeeze", "unsqueeze", "permute"}  # fmt: skip
"""Ops that only make a new view of a tensor: no kernel runs."""


class KernelOps(TorchDispatchMode):
    """Counts the aten ops dispatched inside the block that run a kernel, by name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in METADATA:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def test_an_adapted_projection_is_one_autograd_node_of_eight_gemms():
    base = torch.nn.Linear(16, 12, bias=False)
    base.weight.requires_grad_(False)
    m = LoRALinear(base, rank=4, scale=2.0, dropout=0.0)
    x, g = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 5, 12)
    with KernelOps() as counted:
        y = m(x)
        y.backward(g)
    assert counted.ops == {"mm": 4, "addmm_": 2, "addmm": 2}
    assert type(y.grad_fn).__name__ == f"{LoRAProjection.__name__}Backward"
    assert base.weight.grad is None and m.lora_A.grad is not None and m.lora_B.grad is not None


def _kernels_of_a_step(core) -> collections.Counter[str]:
    t = core._tensors(_batch(_episodes(np.random.default_rng(0)))[0])
    with KernelOps() as counted:
        logprobs_N, _ = core._logprobs(t, 1.0)
        logprobs_N.sum().backward()
    return counted.ops


def test_lora_adds_five_gemms_and_no_other_kernel_per_adapted_projection():
    """A forward and backward of the tiny model: every projection LoRA adapts costs at
    most 5 GEMMs more than the plain one (2 forward, 3 backward: the base's weight gradient
    goes; fewer where no input gradient is needed) and nothing else."""
    full, lora = _kernels_of_a_step(tiny_core()), _kernels_of_a_step(lora_core())
    projections = len(TARGETS) * len(lora_core().model.layers)
    gemms = ("mm", "addmm", "addmm_")
    extra = sum(lora[k] for k in gemms) - sum(full[k] for k in gemms)
    assert 0 < extra <= 5 * projections
    others = {k: lora[k] - full[k] for k in set(full) | set(lora) if k not in gemms}
    assert all(v <= 0 for v in others.values()), others


def test_compiled_lora_blocks_trace_whole_and_match_eager():
    """training.compile: each block with its adapters compiles to one graph (fullgraph),
    gives eager's log-probs and adapter gradients, and a second batch reuses it."""
    core = lora_core()
    nonzero_b(core)
    batches = [_batch(_episodes(np.random.default_rng(s)))[0] for s in (0, 1)]

    def run(mb):
        logprobs_N, _ = core._logprobs(core._tensors(mb), 1.0)
        core.model.zero_grad(set_to_none=True)
        logprobs_N.sum().backward()
        grads = {k: p.grad.clone() for k, p in core.model.named_parameters() if p.requires_grad}
        return logprobs_N.detach(), grads

    eager = [run(mb) for mb in batches]
    apply_compile(core.model, backend="aot_eager")
    compiled = [run(batches[0])]
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled.append(run(batches[1]))
    for (lp_e, grads_e), (lp_c, grads_c) in zip(eager, compiled):
        torch.testing.assert_close(lp_c, lp_e, atol=1e-6, rtol=0)
        assert grads_c.keys() == grads_e.keys() and all(".lora_" in k for k in grads_c)
        for k in grads_e:
            torch.testing.assert_close(grads_c[k], grads_e[k], atol=1e-6, rtol=1e-5)


@pytest.mark.usefixtures("one_rank")
def test_on_one_rank_an_unshard_copies_the_adapters_and_not_the_frozen_base():
    """trainer_procs = 1: FSDP's world-size-1 unshard copies every parameter it manages
    into a buffer of its own (a cast and a copy each in bf16), at every unshard (3 per
    microbatch on a GPU). The frozen base stays a plain tensor outside FSDP, so a LoRA
    block's unshard copies its 14 adapters, not 25 tensors; full training's is as it was."""
    lora, full = lora_core(rank=8, dtype="bfloat16"), tiny_core(dtype="bfloat16")
    counts = {}
    for name, core in (("lora", lora), ("full", full)):
        block = core.model.layers["0"]
        block.unshard()  # the first allocates FSDP's buffers
        block.reshard()
        with KernelOps() as counted:
            block.unshard()
        block.reshard()
        counts[name] = dict(counted.ops)
    adapters, params = 2 * len(TARGETS), len(list(full.model.layers["0"].parameters()))
    assert counts == {
        "lora": {"_to_copy": adapters, "copy_": adapters},
        "full": {"_to_copy": params, "copy_": params},
    }
    for name, p in lora.model.named_parameters():
        assert isinstance(p, DTensor) == p.requires_grad == (".lora_" in name), name


@pytest.mark.usefixtures("one_rank")
def test_with_nothing_to_ignore_fsdp_is_applied_as_without_ignored_params():
    """Multi-rank FSDP and TP + FSDP leave nothing outside FSDP: `fully_shard` is then called
    as before there was an `ignored_params` (an empty set makes FSDP drop the modules with
    no parameters, attention's, from those it marks as managed for Dynamo)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torchtitan_rl.models.qwen3 import ModelConfig, build_model
    from torchtitan_rl.training.parallelize import _shard_blocks_and_root

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    ours, plain = (build_model(ModelConfig(max_seq_len=64), 97, torch.device("cpu")) for _ in "ab")
    _shard_blocks_and_root(ours, mesh, torch.float32, reshard=False)
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in plain.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(plain, mesh=mesh, mp_policy=mp)

    def managed(model):
        return {n for n, m in model.named_modules() if getattr(m, "_is_fsdp_managed_module", 0)}

    assert "layers.0.attention.inner_attention" in managed(plain)
    assert managed(ours) == managed(plain)
