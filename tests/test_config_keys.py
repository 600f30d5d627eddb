"""Keys whose effect no other test shows: each test fails if its key were ignored."""

import json

import numpy as np
import pytest
import torch
from fakes import tiny_core, tiny_qwen3

from torchtitan_rl.controller.config import ParallelismConfig
from torchtitan_rl.envs.base import EnvConfig
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


def test_lr_scales_the_first_update():
    # Adam's first step moves each weight by about lr (times the sign of its gradient)
    assert _moved(lr=1e-3) == pytest.approx(_moved(lr=1e-2) / 10, rel=0.05)


def test_clip_low_decides_which_negative_advantage_ratios_are_clipped():
    from torchtitan_rl.losses.policy_loss import LossConfig, policy_loss
    from torchtitan_rl.reductions import results

    lp = torch.log(torch.tensor([0.7, 0.9]))  # ratio 0.7 and 0.9 against pi_old = 1
    old, adv, seq = torch.zeros(2), -torch.ones(2), torch.tensor([0, 1])
    fracs = []
    for clip_low in (0.2, 0.4):
        _, metrics = policy_loss(
            lp, old, adv, seq, config=LossConfig(clip_low=clip_low),
            num_global_tokens=2, num_global_sequences=2,
        )  # fmt: skip
        fracs.append(results(metrics)["loss/clip_frac"])
    assert fracs == [0.5, 0.0]


def test_max_num_seqs_bounds_the_running_batch():
    import asyncio

    from torchtitan_rl.types import SamplingParams

    engine = Engine(tiny_qwen3(), EngineConfig(max_seq_len=48, max_num_seqs=2))

    async def go():
        prompts = [np.arange(4 + i, dtype=np.int32) for i in range(5)]
        sampling = SamplingParams(temperature=0.0, max_tokens=6)
        done = await asyncio.gather(
            *(
                engine.generate(p, request_id=str(i), sampling=sampling)
                for i, p in enumerate(prompts)
            )
        )
        await engine.close()
        return [c.metrics["generator/inflight_at_completion"] for c in done]

    inflight = asyncio.run(go())
    assert max(inflight) == 2


def test_alphabet_sort_args_shape_the_samples():
    from torchtitan_rl.envs.alphabet_sort import AlphabetSort, AlphabetSortConfig
    from torchtitan_rl.envs.base import EnvConfig

    args = AlphabetSortConfig(min_names=3, max_names=3, sort_by="first")
    env = AlphabetSort(EnvConfig(max_turns=2), 0, args)
    samples = [env.train_sample(i) for i in range(20)]
    assert {s["sort_by"] for s in samples} == {"first"}
    assert {len(names) for s in samples for names in s["names_per_turn"]} == {3}


def test_rollout_max_tokens_reaches_every_request():
    import asyncio

    from fakes import FakeEnvironment, FakeRenderer, ScriptedEnv, always, done

    from torchtitan_rl.rollout.rollouter import RolloutConfig, Rollouter

    generate = always("ok")
    env_config = EnvConfig(max_rollout_tokens=1000)
    rollouter = Rollouter(
        FakeEnvironment(lambda s: ScriptedEnv([done()]), lambda r: 1.0, config=env_config),
        FakeRenderer(), env_config, RolloutConfig(max_tokens=17, group_size=2), seed=0,
    )  # fmt: skip
    asyncio.run(rollouter.collect_batch(1, 0, generate))
    assert {call.sampling.max_tokens for call in generate.calls} == {17}
