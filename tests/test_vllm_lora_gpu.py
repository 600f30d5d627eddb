"""lora.vllm_sync = "adapters" on a GPU: vLLM serving a version's LoRA adapters over the
Qwen3 0.6B shape gives the trainer's log-probs of the merged policy (as test_vllm_gpu.py
checks for merged weights, same tolerances), and after the next version's adapters a
request reads none of the old adapter's keys/values. Marked `gpu` and `vllm`; skipped
without CUDA or without vLLM. Random weights, Qwen3's vocabulary (151,936), rank 8 on all
seven projections with B far from zero.

bfloat16 only: vLLM's GPU LoRA kernels take 16-bit inputs, so float32 with served adapters
on a GPU is refused by the config (test_backends.py); the CPU suite (test_vllm_lora.py)
checks the same paths in float32 with vLLM's CPU build.
"""

import asyncio

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

from test_vllm_gpu import (  # noqa: E402
    CUDA,
    QWEN3_VOCAB,
    REQUESTS,
    SHAPE,
    TOLERANCE,
    _prompts,
    _trainer_logprobs,
    eager_flex,  # noqa: F401 (a fixture)
)

from torchtitan_rl.actors.generator import build_engine  # noqa: E402
from torchtitan_rl.generation.interface import AdapterUse, EngineConfig  # noqa: E402
from torchtitan_rl.models.hf_export import export_hf  # noqa: E402
from torchtitan_rl.models.lora import TARGETS, LoRAConfig  # noqa: E402
from torchtitan_rl.models.qwen3 import build_model  # noqa: E402
from torchtitan_rl.types import SamplingParams  # noqa: E402
from torchtitan_rl.weight_sync.lora_sync import SCALE  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
RANK = 8
NEW_TOKENS = 32


@torch.no_grad()
def _adapters(base: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in base.items():
        if any(name.endswith(f"{tt}.weight") for tt, _ in TARGETS.values()):
            prefix = name.removesuffix(".weight")
            out[f"{prefix}.lora_A"] = torch.randn(RANK, w.shape[1], generator=g) / w.shape[1] ** 0.5
            out[f"{prefix}.lora_B"] = 0.02 * torch.randn(w.shape[0], RANK, generator=g)
    out[SCALE] = torch.tensor(1.0)
    return out


@torch.no_grad()
def _merged_model(model, base: dict, adapters: dict):
    """The trainer's view of the version: the policy with W + B @ A, fp32 on the GPU."""
    merged = dict(base)
    for name in [k.removesuffix(".lora_A") for k in adapters if k.endswith(".lora_A")]:
        a, b = adapters[f"{name}.lora_A"], adapters[f"{name}.lora_B"]
        merged[f"{name}.weight"] = base[f"{name}.weight"] + b @ a
    model.load_state_dict(merged)
    model.use_flex_attention()  # built on CPU (dense SDPA there); the GPU's attention
    return model.to(CUDA)


@pytest.mark.usefixtures("eager_flex")
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_served_adapters_give_the_trainers_logprobs_and_no_old_kv(tmp_path, dtype):
    torch.manual_seed(0)
    model = build_model(SHAPE, QWEN3_VOCAB, torch.device("cpu"))
    base = {k: v.clone() for k, v in model.state_dict().items()}
    folder = export_hf(base, model.model_args, tmp_path / "m", dtype=dtype)
    config = EngineConfig(
        backend="vllm", dtype=dtype, max_num_seqs=REQUESTS, max_seq_len=256, cuda_graphs=False
    )
    lora = LoRAConfig(rank=RANK, alpha=float(RANK), vllm_sync="adapters")
    prompts = _prompts()
    v1, v2 = _adapters(base, 1), _adapters(base, 2)

    async def generate():
        engine = build_engine(SHAPE, config, QWEN3_VOCAB, CUDA, str(folder), lora)
        assert engine.adapter_use is AdapterUse.SERVE
        try:
            engine.load_weights({**base, **v1}, 1)
            sampling = [SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, seed=i)
                        for i in range(REQUESTS)]  # fmt: skip
            first = await asyncio.gather(*(
                engine.generate(p, request_id=f"a{i}", sampling=s)
                for i, (p, s) in enumerate(zip(prompts, sampling))
            ))  # fmt: skip
            engine.load_weights(v2, 2, partial=True)
            again = await engine.generate(prompts[0], request_id="b", sampling=sampling[0])
            return first, again
        finally:
            await engine.close()

    first, again = asyncio.run(generate())
    worst, mean = TOLERANCE[dtype]
    for version, outs in ((v1, first), (v2, [again])):
        trainer = _merged_model(model.cpu(), base, version)
        gaps = np.concatenate([
            np.abs(o.logprobs_N - _trainer_logprobs(trainer, p, o.token_ids_N))
            for o, p in zip(outs, prompts)
        ])  # fmt: skip
        print(f"{dtype} v{outs[0].policy_version_max}: max {gaps.max():.4f} mean {gaps.mean():.5f}")
        assert gaps.max() < worst and gaps.mean() < mean
    assert all((o.policy_version_min, o.policy_version_max) == (1, 1) for o in first)
    assert (again.policy_version_min, again.policy_version_max) == (2, 2)
    assert again.metrics["generator/prefix_hit_tokens"] == 0  # its prompt was cached under v1
