"""Trainer tensor parallelism: a TP=2 step equals the TP=1 step on the same batch.

Two spawned ranks. Rank 0 first trains alone in a 1-rank process group (the production
single-device path: FSDP with its mixed-precision policy); then both ranks train the same
fresh model with tp=2 (mesh dp=1 x tp=2: torchtitan's Qwen3 TP plan, vocab-parallel
LogProbHead) on the same microbatches. Compared: log-probs of the loss tokens before the
step, the loss, the gradient norm, and log-probs after the optimizer step.
CPU: gloo, fp32, tiny model untied and tied, equal to float32 rounding.
GPU (2 CUDA devices): NCCL, bf16 mixed precision, tiny untied and the tied Qwen3-0.6B
shape, eager and with `training.compile` (TP=1 and TP=2 both compiled), within bf16
tolerance; attention runs FlexAttention eagerly (no autotuning), which
keeps the test short and leaves the TP plumbing under test the same.
"""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
from fakes import run_two_ranks

from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.models import qwen3
from torchtitan_rl.rollout.batcher import BatcherConfig, pack_batch
from torchtitan_rl.training.trainer import TrainerCore
from torchtitan_rl.training.trainer_config import TrainingConfig
from torchtitan_rl.types import Episode

VOCAB = 96
SEQ_LEN = 64
UNIFORM_LOGPROB = -float(np.log(VOCAB))
"""Generator log-prob near a random-init policy's, so importance ratios start near 1."""


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    episodes = []
    for i in range(10):
        length = int(rng.integers(8, 40))
        mask = np.zeros(length, bool)
        mask[length // 3 :] = True
        advantage = rng.uniform(0.5, 1.5) * (1 if i % 3 else -1)
        episodes.append(
            Episode(
                token_ids_L=rng.integers(0, VOCAB, length).astype(np.int32),
                loss_mask_L=mask,
                logprobs_L=np.where(mask, UNIFORM_LOGPROB, 0).astype(np.float32),
                advantages_L=np.where(mask, advantage, 0).astype(np.float32),
                rollout_id=i,
            )
        )
    config = BatcherConfig(seq_len=SEQ_LEN, rows_per_microbatch=2)
    batches, _ = pack_batch(episodes, config=config, num_ranks=1, pad_id=0)
    return batches[0]


def _step(device, flavor, dtype, compile, tp, batch):
    core = TrainerCore(
        model_config=qwen3.ModelConfig(flavor=flavor, max_seq_len=SEQ_LEN),
        training=TrainingConfig(lr=1e-3, dtype=dtype, compile=compile),
        loss=LossConfig(),
        correction=CorrectionConfig(),
        vocab_size=VOCAB,
        device=device,
        seed=0,
        tp=tp,
    )
    before = np.concatenate([core.logprobs(mb) for mb in batch])
    out = core.train_step([batch], temperature=1.0)
    after = np.concatenate([core.logprobs(mb) for mb in batch])
    return {
        "loss": out["loss/mean"],
        "grad_norm": out["trainer/grad_norm"],
        "before": before,
        "after": after,
    }


def _worker(rank, port, device_type, cases, queue):
    backend = "nccl" if device_type == "cuda" else "gloo"
    try:
        torch.set_num_threads(1)
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(device)
            from torch.nn.attention.flex_attention import flex_attention

            from torchtitan_rl.models.qwen3 import FlexAttention

            FlexAttention._compiled_defaults = flex_attention  # eager: no compile
        batch = _batch()
        results = {}
        for flavor, tied, dtype, compile in cases:
            # this process only: the tiny shape with the head tied to the embedding
            qwen3.BUILTIN_ARGS["tiny"] = {**qwen3.TINY_ARGS, "enable_weight_tying": tied}
            key = (flavor, tied, compile)
            if rank == 0:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
                results[key, 1] = _step(device, flavor, dtype, compile, 1, batch)
                dist.destroy_process_group()
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
            )
            results[key, 2] = _step(device, flavor, dtype, compile, 2, batch)
            dist.destroy_process_group()
            port += 1
        queue.put((rank, results))
    except Exception:
        queue.put((rank, traceback.format_exc()))


def _run(device_type, cases):
    return run_two_ranks(_worker, device_type, cases, ports=len(cases))


def _compare(results, key):
    one, two, two_b = results[0][key, 1], results[0][key, 2], results[1][key, 2]
    diffs = {
        "loss_rel": abs(two["loss"] - one["loss"]) / abs(one["loss"]),
        "grad_norm_rel": abs(two["grad_norm"] - one["grad_norm"]) / one["grad_norm"],
        "before_max_abs": float(np.abs(two["before"] - one["before"]).max()),
        "after_max_abs": float(np.abs(two["after"] - one["after"]).max()),
    }
    print(f"{key}: TP=1 loss {one['loss']:.6f} grad_norm {one['grad_norm']:.6f}; TP=2 "
          f"loss {two['loss']:.6f} grad_norm {two['grad_norm']:.6f}; "
          + " ".join(f"{k} {v:.2e}" for k, v in diffs.items()))  # fmt: skip
    # both TP ranks report the same step
    assert two["loss"] == two_b["loss"] and two["grad_norm"] == two_b["grad_norm"]
    np.testing.assert_array_equal(two["before"], two_b["before"])
    return diffs


def test_tp2_step_equals_tp1_step_on_cpu():
    cases = [("tiny", False, "float32", False), ("tiny", True, "float32", False)]
    results = _run("cpu", cases)
    for flavor, tied, _, compile in cases:
        diffs = _compare(results, (flavor, tied, compile))
        assert diffs["loss_rel"] < 1e-5 and diffs["grad_norm_rel"] < 1e-5, diffs
        assert diffs["before_max_abs"] < 1e-4 and diffs["after_max_abs"] < 1e-4, diffs


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_step_matches_tp1_step_on_two_gpus_in_bf16():
    cases = [
        ("tiny", False, "bfloat16", False),
        ("0.6B", True, "bfloat16", False),
        ("0.6B", True, "bfloat16", True),  # training.compile: per-block torch.compile
    ]
    results = _run("cuda", cases)
    for flavor, tied, _, compile in cases:
        diffs = _compare(results, (flavor, tied, compile))
        # bf16 keeps 8 bits of mantissa (relative step 2^-8 = 3.9e-3); TP changes the
        # summation order of every row-parallel matmul, so allow a few such steps
        assert diffs["loss_rel"] < 2e-2 and diffs["grad_norm_rel"] < 2e-2, diffs
        assert diffs["before_max_abs"] < 5e-2, diffs


def test_tp_must_divide_trainer_procs_and_rows():
    from torchtitan_rl.config import ConfigError, load_config
    from torchtitan_rl.config.job import check_lengths

    root = "train_configs/alphabet_sort_tiny.toml"
    assert load_config(root, ["--parallelism.tp=2"]).parallelism.dp == 1
    with pytest.raises(ConfigError, match="parallelism.tp"):
        load_config(root, ["--parallelism.tp=3"])
    with pytest.raises(ConfigError, match="parallelism.tp"):
        load_config(root, ["--parallelism.tp=0"])
    with pytest.raises(ValueError, match="parallelism.tp=2"):
        check_lengths(model_max_seq_len=512, batcher_seq_len=255, tp=2)
