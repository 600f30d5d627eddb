"""Keys whose effect no other test shows: each test fails if its key were ignored."""

import json

import numpy as np
import pytest
import torch
from fakes import tiny_core, tiny_qwen3

from torchtitan_rl.controller.config import ParallelismConfig
from torchtitan_rl.generation.engine import Engine, EngineConfig
from torchtitan_rl.models.hf_export import export_hf
from torchtitan_rl.rollout.batcher import BatcherConfig, pack_batch
from torchtitan_rl.types import Episode

VOCAB = 96


def _core(**training):
    return tiny_core(**training)


def _batch():
    rng = np.random.default_rng(0)
    episodes = []
    for i in range(4):
        mask = np.zeros(16, bool)
        mask[8:] = True
        episodes.append(
            Episode(
                token_ids_L=rng.integers(0, VOCAB, 16).astype(np.int32),
                loss_mask_L=mask,
                logprobs_L=np.where(mask, -3.0, 0).astype(np.float32),
                advantages_L=np.where(mask, 1.0 if i % 2 else -1.0, 0).astype(np.float32),
            )
        )
    config = BatcherConfig(seq_len=64, rows_per_microbatch=2)
    return pack_batch(episodes, config=config, num_ranks=1, pad_id=0)[0][0]


def _moved(**training) -> float:
    """How far one RL step moves the weights (L2 over all tensors)."""
    core = _core(**training)
    before = {k: v.clone() for k, v in core.full_state_dict().items()}
    core.train_step([_batch()], 1.0)
    after = core.full_state_dict()
    return sum(float((after[k] - before[k]).norm() ** 2) for k in before) ** 0.5


def test_max_grad_norm_clips_the_update():
    # Adam divides by the gradient's own scale; a gradient clipped far below eps barely moves
    assert _moved(max_grad_norm=1e-12) < 1e-3 * _moved(max_grad_norm=0.0)


def test_weight_decay_changes_the_update():
    assert _moved(weight_decay=0.5) != _moved(weight_decay=0.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_dtype_is_the_dtype_of_the_exported_weights(tmp_path, dtype):
    from safetensors import safe_open

    model = tiny_qwen3()
    folder = export_hf(model.state_dict(), model.model_args, tmp_path / "hf", dtype=dtype)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes == {getattr(torch, dtype)}
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == dtype


def test_cpu_threads_per_proc_overrides_the_core_split():
    assert ParallelismConfig(cpu_threads_per_proc=3).threads(generator_procs=1) == 3
    split = ParallelismConfig(trainer_procs=1).threads(generator_procs=1)
    assert split == max(1, (__import__("os").cpu_count() or 1) // 2)


def test_decode_attention_picks_the_kernel_and_refuses_triton_on_cpu():
    engine = Engine(tiny_qwen3(), EngineConfig(max_seq_len=64, decode_attention="auto"))
    assert engine.runner.decode_attention == "gather"
    with pytest.raises(ValueError, match="triton"):
        Engine(tiny_qwen3(), EngineConfig(max_seq_len=64, decode_attention="triton"))
