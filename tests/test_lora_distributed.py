"""LoRA under FSDP2 and tensor parallelism (two gloo ranks on CPU): the sharded policy with
adapters gives the unsharded one's log-probs before and after a step, and the weights rank 0
packs for a generator are the merged ones.

Rank 0 first runs the one-process reference (no process group: no FSDP); then both ranks
run FSDP over 2 ranks (tp=1) and TP over 2 ranks (tp=2) on the same batch, with every B
set to the same nonzero values (B starts at zero, which would hide a misplaced B)."""

from __future__ import annotations

import traceback

import numpy as np
import torch
import torch.distributed as dist
from fakes import TRAINER_VOCAB, run_two_ranks
from test_trainer import _episodes

from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.models.lora import LoRAConfig
from torchtitan_rl.models.qwen3 import ModelConfig
from torchtitan_rl.rollout.batcher import BatcherConfig, pack_batch
from torchtitan_rl.training.trainer import TrainerCore
from torchtitan_rl.training.trainer_config import TrainingConfig
from torchtitan_rl.weight_sync.packing import gather_into, make_layout, pack_weights, unpack_weights


def _core(tp: int) -> TrainerCore:
    core = TrainerCore(
        model_config=ModelConfig(max_seq_len=64),
        training=TrainingConfig(lr=1e-2),
        loss=LossConfig(),
        correction=CorrectionConfig(),
        vocab_size=TRAINER_VOCAB,
        device=torch.device("cpu"),
        seed=0,
        tp=tp,
        lora=LoRAConfig(
            rank=4, alpha=6.0, target_modules=["q_proj", "o_proj", "up_proj", "down_proj"]
        ),
    )
    _set_b(core)
    return core


@torch.no_grad()
def _set_b(core: TrainerCore) -> None:
    """The same nonzero B on every layout: drawn full, then this rank's part copied in."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from torchtitan_rl.models.lora import lora_modules

    g = torch.Generator().manual_seed(1)
    for _, m in lora_modules(core.model):
        full = 0.05 * torch.randn(m.lora_B.shape, generator=g)
        b = m.lora_B
        if isinstance(b, DTensor):
            b.to_local().copy_(distribute_tensor(full, b.device_mesh, b.placements).to_local())
        else:
            b.copy_(full)


def _batch(dp: int, rank: int):
    """This data-parallel rank's microbatches of one fixed batch (dp = 1: all of it)."""
    config = BatcherConfig(seq_len=64, rows_per_microbatch=2)
    episodes = _episodes(np.random.default_rng(0), n=8)
    return pack_batch(episodes, config=config, num_ranks=dp, pad_id=0)[0][rank]


def _run(core: TrainerCore, rank: int) -> dict:
    whole = _batch(1, 0)
    before = np.concatenate([core.logprobs(mb) for mb in whole])
    out = core.train_step([_batch(2 // core.tp if dist.is_initialized() else 1, core.dp_rank)], 1.0)
    after = np.concatenate([core.logprobs(mb) for mb in whole])
    state = core.sync_state()
    # open_broadcast takes the layout on rank 0 alone: without the merges' gathers
    same_layout = make_layout(core.sync_state(merge=False)) == make_layout(state)
    packed = pack_weights(state, 0) if rank == 0 else gather_into(state, None)
    full = core.full_state_dict()
    result = {"before": before, "after": after, "grad_norm": out["trainer/grad_norm"]}
    result["same_layout"] = same_layout
    optimized = {id(p) for g in core.optimizer.param_groups for p in g["params"]}
    result["optimized"] = sorted(n for n, p in core.model.named_parameters() if id(p) in optimized)
    if rank == 0:
        back = unpack_weights(packed)
        result["names"] = (list(back), list(full))
        result["packed_vs_full"] = max(float((back[k] - full[k]).abs().max()) for k in full)
        result["full"] = {
            k: v.numpy().copy() for k, v in full.items()
        }  # tensors die with the process
    return result


def _worker(rank, port, queue):
    try:
        torch.set_num_threads(1)
        out = {}
        if rank == 0:
            out["single"] = _run(_core(1), 0)
        for i, tp in enumerate((1, 2)):
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port + i}", rank=rank, world_size=2
            )
            out[tp] = _run(_core(tp), rank)
            dist.destroy_process_group()
        queue.put((rank, out))
    except Exception:
        queue.put((rank, traceback.format_exc()))


def test_lora_under_fsdp_and_tp_matches_the_unsharded_policy_and_packs_merged_weights():
    results = run_two_ranks(_worker, ports=2, timeout=300)
    single = results[0]["single"]
    assert np.abs(single["after"] - single["before"]).max() > 1e-2  # the step moved it
    for tp in (1, 2):
        for rank in (0, 1):
            got = results[rank][tp]
            np.testing.assert_allclose(got["before"], single["before"], atol=2e-6, rtol=0)
            np.testing.assert_allclose(got["after"], single["after"], atol=2e-5, rtol=0)
            # TP's plan re-creates norms and the head as trainable: they must stay frozen
            assert got["optimized"] == single["optimized"], tp
            assert got["same_layout"]
            assert all(n.endswith(("lora_A", "lora_B")) for n in got["optimized"])
            assert abs(got["grad_norm"] - single["grad_norm"]) < 1e-5 * single["grad_norm"]
        r0 = results[0][tp]
        assert r0["names"][0] == r0["names"][1] == list(single["full"])
        assert r0["packed_vs_full"] < 1e-6, tp
        for k, v in single["full"].items():
            assert np.abs(r0["full"][k] - v).max() < 2e-5, (tp, k)
