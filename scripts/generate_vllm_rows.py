"""The vLLM rows of `bench_generate.py`: plain `vllm.LLM`, and the vllm backend
(`VllmEngine`), on the same random weights as the native engine, exported as a Hugging Face
folder. vLLM is imported inside the functions, so this module imports without it."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import torch
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.types import SamplingParams


def export_folder(model, folder: Path) -> str:
    """`model` as a Hugging Face folder, the start of a vLLM engine."""
    from torchtitan_rl.models.hf_export import export_hf

    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    return str(export_hf(state, model.model_args, folder))


def run_vllm_llm(model, args, prompts: np.ndarray, dtype_name: str) -> dict:
    """The same prompts through plain vLLM (`vllm.LLM`, its defaults: torch.compile and CUDA
    graphs, no per-request seeds or log-probs), as a vLLM user would run it."""
    import gc
    import tempfile

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm import SamplingParams as VllmSampling

    with tempfile.TemporaryDirectory() as tmp:
        folder = export_folder(model, Path(tmp) / "hf")
        t0 = time.perf_counter()
        llm = LLM(
            model=folder,
            dtype=dtype_name,
            skip_tokenizer_init=True,
            gpu_memory_utilization=0.5,
            max_model_len=args.prompt_len + args.output_len,
            max_num_seqs=args.num_requests,
            seed=0,
        )
        setup_s = time.perf_counter() - t0
    requests = [{"prompt_token_ids": p.tolist()} for p in prompts]

    def sampling(max_tokens: int):
        return VllmSampling(
            temperature=1.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )

    llm.generate(requests[:8], sampling(16), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(requests, sampling(args.output_len), use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.llm_engine.engine_core.shutdown()
    del llm
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()  # frees its memory for the next row
    gc.collect()
    torch.cuda.empty_cache()
    return {"output_tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall, "setup_s": setup_s}


def run_vllm(model, args, prompts: np.ndarray, device, dtype_name: str) -> dict:
    """The same requests through the vllm backend (`VllmEngine`, what a run with
    generator.backend = "vllm" generates with)."""
    import tempfile

    from torchtitan_rl.generation.vllm_engine import start_vllm_engine

    config = EngineConfig(
        backend="vllm",
        max_num_seqs=args.num_requests,
        max_seq_len=args.prompt_len + args.output_len,
        dtype=dtype_name,
        block_size=16 if device.type == "cuda" else 32,
        enable_prefix_cache=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_folder(model, Path(tmp) / "hf")
        adapter = Qwen3StateDictAdapter(model.model_args, None)
        t0 = time.perf_counter()
        engine = start_vllm_engine(folder, config, device, state_dict_adapter=adapter)
        setup_s = time.perf_counter() - t0

    async def generate(max_tokens: int):
        return await asyncio.gather(
            *(
                engine.generate(
                    p,
                    request_id=str(i),
                    sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i),
                )
                for i, p in enumerate(prompts)
            )
        )

    async def main():
        await generate(4)
        t0 = time.perf_counter()
        outs = await generate(args.output_len)
        wall = time.perf_counter() - t0
        await engine.close()
        return outs, wall

    outs, wall = asyncio.run(main())
    tokens = sum(c.num_tokens for c in outs)
    return {"output_tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall, "setup_s": setup_s}
