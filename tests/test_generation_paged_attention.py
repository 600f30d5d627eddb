"""The Triton paged decode attention against a float64 reference (CUDA only).

Reference (independent of the kernel): for each sequence, the keys/values of positions
0..pos are read block by block through its table in float64, then softmax(q k^T * scale) v
with query head h using key/value head h // G.
"""

import pytest
import torch

from torchtitan_rl.generation.paged_attention import paged_decode_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def reference(q_BHqD, k_HRD, v_HRD, table_BN, pos_B, block_size, scale):
    B, Hq, D = q_BHqD.shape
    G = Hq // k_HRD.shape[0]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        p = torch.arange(int(pos_B[b]) + 1)
        rows = table_BN[b, p // block_size].cpu() * block_size + p % block_size
        for h in range(Hq):
            k = k_HRD[h // G, rows].double().cpu()
            v = v_HRD[h // G, rows].double().cpu()
            w = torch.softmax(k @ q_BHqD[b, h].double().cpu() * scale, dim=0)
            out[b, h] = w @ v
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_attention_matches_float64_reference(dtype, group, splits):
    gen = torch.Generator().manual_seed(group)
    B, Hkv, D, bs, num_blocks, N = 5, 2, 64, 16, 40, 7
    k = torch.randn(Hkv, num_blocks * bs, D, generator=gen).to("cuda", dtype)
    v = torch.randn(Hkv, num_blocks * bs, D, generator=gen).to("cuda", dtype)
    q = torch.randn(B, Hkv * group, D, generator=gen).to("cuda", dtype)
    table = torch.randperm(num_blocks, generator=gen)[: B * N].view(B, N).to("cuda")
    pos = torch.tensor([0, 15, 16, 63, N * bs - 1], device="cuda")  # block edges included
    out = paged_decode_attention(
        q, k, v, table, pos, block_size=bs, scale=D**-0.5, tile=16, splits=splits
    )
    ref = reference(q, k, v, table, pos, bs, D**-0.5)
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def test_cuda_engine_with_graphs_and_paged_kernel_matches_cpu_engine():
    import asyncio

    import numpy as np
    from test_engine import prompt, tiny_qwen3

    from torchtitan_rl.generation.engine import Engine
    from torchtitan_rl.generation.interface import EngineConfig
    from torchtitan_rl.types import SamplingParams

    config = dict(max_num_seqs=4, max_seq_len=48, block_size=4)
    samplings = [SamplingParams(temperature=0.0, max_tokens=20 + i) for i in range(6)]

    async def serve(device):
        engine = Engine(tiny_qwen3(), EngineConfig(**config), device)
        outs = await asyncio.gather(
            *(
                engine.generate(prompt(3 + 2 * i, i), request_id=str(i), sampling=s)
                for i, s in enumerate(samplings)
            )
        )
        await engine.close()
        return engine, outs

    engine, gpu = asyncio.run(serve("cuda"))
    assert engine.runner.decode_graphs is not None and engine.runner.decode_attention == "triton"
    _, cpu = asyncio.run(serve("cpu"))
    for got, ref in zip(gpu, cpu):
        np.testing.assert_array_equal(got.token_ids_N, ref.token_ids_N)
        np.testing.assert_allclose(got.logprobs_N, ref.logprobs_N, atol=1e-4)
