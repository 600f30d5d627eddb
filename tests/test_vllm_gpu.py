"""generator.backend = "vllm" on a GPU (issue 31): log-probs against the trainer's on the
Qwen3 0.6B shape in fp32 and bf16, a weight pull between engine steps, 3 RL steps through
Monarch. Marked `gpu` and `vllm`; skipped without CUDA or without vLLM.

All four passed on one H100 with vLLM 0.26.0 (2026-11-26; each test prints its numbers). On
the GPU image (torch 2.11) only vLLM 0.26.0 installs; README "vLLM backend" gives the command. Random weights: a Qwen3 0.6B shape with Qwen3's vocabulary (151,936).
"""

import asyncio
import copy
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

from driver import drive  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter  # noqa: E402

from torchtitan_rl.config import load_config  # noqa: E402
from torchtitan_rl.generation.interface import EngineConfig  # noqa: E402
from torchtitan_rl.generation.vllm_engine import start_vllm_engine  # noqa: E402
from torchtitan_rl.models.hf_export import export_hf  # noqa: E402
from torchtitan_rl.models.qwen3 import FlexAttention, ModelConfig, build_model  # noqa: E402
from torchtitan_rl.types import FinishReason, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[1]
QWEN3_VOCAB = 151936
SHAPE = ModelConfig(flavor="0.6B", max_seq_len=512)
CUDA = torch.device("cuda")
PROMPT_LEN, NEW_TOKENS, REQUESTS = 64, 32, 8
TOLERANCE = {"float32": (5e-3, 1e-3), "bfloat16": (0.1, 0.03)}
"""(max, mean) |log mu - log pi_trainer| per sampled token. Measured on one H100 with vLLM
0.26.0, 2026-11-26, 256 tokens: fp32 max 0.0019, mean 0.00046 (vLLM's GPU kernels are not the
trainer's; CPU saw 1e-6); bf16 max 0.028, mean 0.0089. The bounds are those with ~2.5-3.5x
room."""


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """(model on CPU in fp32, HF folders in fp32 and bf16) of one random 0.6B-shape policy."""
    torch.manual_seed(0)
    model = build_model(SHAPE, QWEN3_VOCAB, CUDA).cpu()
    folders = {
        dtype: export_hf(
            model.state_dict(), model.model_args, tmp_path_factory.mktemp(dtype) / "m", dtype=dtype
        )
        for dtype in TOLERANCE
    }
    return model, folders


@pytest.fixture
def eager_flex(monkeypatch):
    """The trainer's flex attention eager (no compile), as test_trainer does."""
    monkeypatch.setattr(FlexAttention, "_compiled_defaults", flex_attention)


def _engine(model, folder, dtype: str):
    config = EngineConfig(
        backend="vllm", dtype=dtype, max_num_seqs=REQUESTS, max_seq_len=256, cuda_graphs=False
    )
    adapter = Qwen3StateDictAdapter(model.model_args, None)
    return start_vllm_engine(str(folder), config, CUDA, state_dict_adapter=adapter)


def _prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, QWEN3_VOCAB, PROMPT_LEN, dtype=np.int64) for _ in range(REQUESTS)]


@torch.no_grad()
def _trainer_logprobs(model, prompt: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The trainer's fp32 log-probs of `tokens` after `prompt` (PolicyModel.forward)."""
    ids = torch.as_tensor(np.concatenate([prompt, tokens]), device=CUDA)[None]
    n = ids.shape[1]
    logprobs_N, _ = model(
        ids,
        torch.arange(n, device=CUDA)[None],
        torch.zeros(1, n, dtype=torch.long, device=CUDA),
        torch.arange(len(prompt) - 1, n - 1, device=CUDA),
        torch.as_tensor(tokens, device=CUDA),
    )
    return logprobs_N.float().cpu().numpy()


@torch.no_grad()
def _trainer_greedy(model, prompt: np.ndarray, num_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(num_tokens):
        x = torch.as_tensor(ids, device=CUDA)[None]
        n = x.shape[1]
        logits = model(
            x,
            torch.arange(n, device=CUDA)[None],
            torch.zeros(1, n, dtype=torch.long, device=CUDA),
            torch.tensor([n - 1], device=CUDA),
            None,
        )
        ids.append(int(logits[0].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_logprobs_match_the_trainers_on_the_qwen3_shape(policy, eager_flex, dtype):
    """Temperature 1, full vocabulary: each sampled token's vLLM log-prob is the trainer's
    log-prob of it (same weights, same dtype) within TOLERANCE[dtype]."""
    model, folders = policy

    async def generate():
        engine = _engine(model, folders[dtype], dtype)
        try:
            return await asyncio.gather(
                *(
                    engine.generate(
                        p,
                        request_id=str(i),
                        sampling=SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, seed=i),
                    )
                    for i, p in enumerate(_prompts())
                )
            )
        finally:
            await engine.close()

    done = asyncio.run(generate())
    assert all(c.finish_reason == FinishReason.LENGTH for c in done), [c.error for c in done]
    # the trainer in bf16 as the reference model runs (training/reference.py: .to(dtype))
    trainer = copy.deepcopy(model).to(CUDA, getattr(torch, dtype))
    diffs = np.concatenate(
        [
            c.logprobs_N - _trainer_logprobs(trainer, p, c.token_ids_N)
            for c, p in zip(done, _prompts())
        ]
    )
    del trainer
    torch.cuda.empty_cache()
    mu = np.concatenate([c.logprobs_N for c in done])
    print(
        f"vLLM vs trainer, {dtype}: max |diff| {np.abs(diffs).max():.3g}, "
        f"mean {np.abs(diffs).mean():.3g}, over {diffs.size} tokens (log mu std {mu.std():.3g})"
    )
    worst, mean = TOLERANCE[dtype]
    assert np.abs(diffs).max() < worst and np.abs(diffs).mean() < mean


def test_a_weight_pull_between_engine_steps_gives_the_new_weights_tokens(
    policy, eager_flex, caplog
):
    """fp32. A pull from GPU tensors while a request runs: it carries both versions; a greedy
    request after the pull gives the trainer's greedy tokens on the new weights (not the old
    ones'), reuses no prefix block, and the log names the device path."""
    model, folders = policy
    torch.manual_seed(1)
    new_model = build_model(SHAPE, QWEN3_VOCAB, CUDA).cpu()  # to the GPU once vLLM started
    prompt = _prompts()[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)

    async def run():
        engine = _engine(model, folders["float32"], "float32")
        try:
            before = await engine.generate(prompt, request_id="before", sampling=greedy)
            long = asyncio.ensure_future(
                engine.generate(prompt, request_id="long", sampling=SamplingParams(max_tokens=96))
            )
            while not engine._running:
                await asyncio.sleep(0)
            await asyncio.sleep(0)
            new_model.to(CUDA)
            engine.load_weights({k: v.detach() for k, v in new_model.state_dict().items()}, 1)
            after = await engine.generate(prompt, request_id="after", sampling=greedy)
            return before, await long, after
        finally:
            await engine.close()

    with caplog.at_level(logging.INFO, logger="torchtitan_rl.generation.vllm_engine"):
        before, long, after = asyncio.run(run())
    assert "weights on the device" in caplog.text
    assert (long.policy_version_min, long.policy_version_max) == (0, 1)
    assert (after.policy_version_min, after.policy_version_max) == (1, 1)
    assert after.metrics["generator/prefix_hit_tokens"] == 0
    assert after.token_ids_N.tolist() == _trainer_greedy(new_model, prompt, 8)
    assert after.token_ids_N.tolist() != before.token_ids_N.tolist(), "the weights changed"


def test_three_rl_steps_through_monarch_with_vllm_on_one_gpu(tmp_path):
    """The 0.6B job that failed at start-up on vLLM 0.26 (issue 31), shortened: the
    generator's version follows the trainer's through three RL steps and vLLM started."""
    config = load_config(
        ROOT / "train_configs" / "alphabet_sort_qwen3_0.6b.toml",
        [
            f"--job.output_dir={tmp_path}",
            "--job.run_name=vllm_gpu",
            "--generator.backend=vllm",
            "--generator.max_num_seqs=16",
            "--warm_start.steps=2",
            "--warm_start.batch_size=4",
            "--training.compile=false",
            "--rollout.group_size=4",
            "--rollout.prompts_per_step=2",
            "--rollout.max_tokens=16",
            "--rollout.filter_zero_std_groups=false",
            "--validation.interval=0",
        ],
    )

    run = drive(config, steps=3)
    steps, version = run.steps, run.generator_version
    print({k: [m[k] for m in steps] for k in ("trainer/policy_version", "perf/step_seconds")})
    assert [m["trainer/policy_version"] for m in steps] == [3, 4, 5]
    assert version == 5, "the generator holds the trainer's latest weights"
    assert (tmp_path / "vllm_gpu" / "generator_start_hf" / "config.json").is_file()
    assert all(np.isfinite(m["trainer/logprob_diff/max"]) for m in steps)
