"""On CUDA with `generator.batch_invariant = true`, a request's tokens and log-probs are the
same bits whatever shares its steps: alone, with others, staggered, in another order, behind
a cached prefix, preempted, from CUDA graphs or eager (generation/invariant_kernels.py; the
CPU twin is tests/test_batch_invariance.py, the kernels' numerics under the interpreter
tests/test_invariant_kernels.py). With the mode off the bits may differ: that difference is
measured and reported (`record_property`, printed with -s), not asserted, since nothing
guarantees it on a given GPU and library version.

Run: pytest -m gpu tests/test_batch_invariance_gpu.py
"""

from __future__ import annotations

import functools
import gc

import numpy as np
import pytest
import torch
from fakes import tiny_qwen3
from test_batch_invariance import PROMPTS, behind_a_cached_prefix, run, staggered
from test_batch_invariance import together as together_in
from test_model_runner import VOCAB

from torchtitan_rl.generation.cuda_graphs import DecodeGraphs, MixedGraphs
from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.generation.model_runner import ModelRunner, SeqInput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@functools.cache
def qwen3_06b_state() -> dict[str, torch.Tensor]:
    """Random weights of the Qwen3-0.6B shape (bf16, on the GPU), built once."""
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    torch.manual_seed(0)
    with torch.device("cuda"), torch.no_grad():
        model = Qwen3Model(qwen3_args["0.6B"])
        model.init_weights(buffer_device=torch.device("cuda"))
    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


def qwen3_06b():
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    with torch.device("meta"):
        model = Qwen3Model(qwen3_args["0.6B"])
    model = model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cuda"))  # buffers (rope)
    model.load_state_dict(qwen3_06b_state())
    return model


MODELS = {"tiny-fp32": (tiny_qwen3, "float32"), "qwen3-0.6b-bf16": (qwen3_06b, "bfloat16")}


def cuda_engine(model: str, *, batch_invariant=True, max_num_seqs=8, threaded=False, **changes):
    gc.collect()  # an earlier engine's graphs and cache
    build, dtype = MODELS[model]
    config = EngineConfig(
        max_num_seqs=max_num_seqs, max_seq_len=96, block_size=4, dtype=dtype,
        batch_invariant=batch_invariant, **changes,
    )  # fmt: skip
    return Engine(build(), config, "cuda", threaded=threaded, steps_per_yield=1)


def together(e, order):
    return run(together_in(e, order))


def largest_difference(got: dict, ref: dict) -> tuple[int, float]:
    """(requests whose tokens or log-probs differ, largest log-prob difference where the
    tokens agree)."""
    differ, largest = 0, 0.0
    for i, want in ref.items():
        same_tokens = np.array_equal(got[i].token_ids_N, want.token_ids_N)
        differ += not (same_tokens and np.array_equal(got[i].logprobs_N, want.logprobs_N))
        if same_tokens:
            largest = max(largest, float(np.abs(got[i].logprobs_N - want.logprobs_N).max()))
    return differ, largest


@pytest.mark.parametrize("model", list(MODELS))
def test_every_request_gets_the_same_bits_in_any_company_on_cuda(model, record_property):
    order = list(range(len(PROMPTS)))
    ref = together(cuda_engine(model), order)
    variants = {
        "one at a time": together(cuda_engine(model, max_num_seqs=1), order),
        "reversed": together(cuda_engine(model), order[::-1]),
        "threaded, staggered": run(staggered(cuda_engine(model, threaded=True), order, 0.003)),
        "three slots, shuffled": together(
            cuda_engine(model, max_num_seqs=3), [5, 0, 7, 2, 6, 1, 4, 3]
        ),
        "behind a cached prefix": run(behind_a_cached_prefix(cuda_engine(model), order)),
        "tight cache (preemption)": together(cuda_engine(model, num_blocks=40), order),
        "eager (no CUDA graphs)": together(cuda_engine(model, cuda_graphs=False), order[::-1]),
    }
    assert any(c.metrics["generator/prefix_hit_tokens"] > 0
               for c in variants["behind a cached prefix"].values())  # fmt: skip
    assert any(c.metrics["generator/preemptions"] > 0
               for c in variants["tight cache (preemption)"].values())  # fmt: skip
    for name, got in variants.items():
        for i in order:
            np.testing.assert_array_equal(got[i].token_ids_N, ref[i].token_ids_N, err_msg=name)
            np.testing.assert_array_equal(got[i].logprobs_N, ref[i].logprobs_N, err_msg=name)

    # The mode off (torch.compile, cuBLAS, the fused sampler): reported, not asserted.
    off_ref = together(cuda_engine(model, batch_invariant=False), order)
    off = {
        "one at a time": together(cuda_engine(model, batch_invariant=False, max_num_seqs=1), order),
        "reversed": together(cuda_engine(model, batch_invariant=False), order[::-1]),
    }
    for name, got in off.items():
        differ, largest = largest_difference(got, off_ref)
        record_property(f"off: {name}", f"{differ} requests differ, max |dlogprob| {largest:.3g}")
        print(f"{model}, mode off, {name}: {differ} of {len(order)} requests differ, "
              f"largest log-prob difference {largest:.3g}")  # fmt: skip
    if model != "tiny-fp32":  # bf16 numerics: test_invariant_kernels_give_each_row_its_bits...
        return
    # on and off compute the same model: close, not equal (up to the first other token)
    for i in order:
        n = min(len(off_ref[i].logprobs_N), len(ref[i].logprobs_N))
        same = off_ref[i].token_ids_N[:n] == ref[i].token_ids_N[:n]
        first = int(np.argmin(same)) if not same.all() else n  # up to the first other token
        np.testing.assert_allclose(
            off_ref[i].logprobs_N[:first], ref[i].logprobs_N[:first], atol=1e-3, rtol=0
        )


def invariant_runner(dtype: torch.dtype, *, graphs: bool, max_seq_len: int = 512):
    torch.manual_seed(0)
    runner = ModelRunner(
        tiny_qwen3(), num_blocks=160, block_size=4, max_seq_len=max_seq_len, device="cuda",
        dtype=dtype, batch_invariant=True,
    )  # fmt: skip
    if graphs:
        runner.decode_graphs = DecodeGraphs(runner, max_batch=48)
        runner.mixed_graphs = MixedGraphs(runner, max_rows=48, max_tokens=256)
    return runner


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("graphs", [True, False])
def test_a_rows_logits_are_the_same_bits_beside_any_rows_on_cuda(dtype, graphs):
    """Row: its 30th token after 29 cached ones, alone (a decode step), beside decode rows
    (1 to 40 of them: several decode-graph buckets), beside a prefill row (a mixed graph),
    beside a 300-token prefill (eager); and the same 30 tokens prefilled in one step, or
    fed one at a time: all the same bits."""
    runner = invariant_runner(dtype, graphs=graphs)
    tokens = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(5)).tolist()
    table = list(range(8))
    runner.forward([SeqInput(token_ids=tokens[:29], start=0, block_table=table)])
    row = SeqInput(token_ids=[tokens[29]], start=29, block_table=table)
    alone = runner.forward([row]).clone()
    for others in (1, 15, 16, 40):
        beside = [
            SeqInput(token_ids=[tokens[i]], start=40 + i % 20, block_table=list(range(16, 32)))
            for i in range(others)
        ]
        decode = runner.forward([*beside[: others // 2], row, *beside[others // 2 :]])
        assert torch.equal(decode[others // 2], alone[0]), ("decode", others)
        prefill = SeqInput(token_ids=tokens[:21], start=0, block_table=list(range(40, 48)))
        mixed = runner.forward([*beside[: others // 2], row, prefill])
        assert torch.equal(mixed[others // 2], alone[0]), ("mixed", others)
    long = SeqInput(token_ids=tokens[:300], start=0, block_table=list(range(80, 160)))
    eager = runner.eager["eager_prefills"]
    assert torch.equal(runner.forward([row, long])[0], alone[0]), "beside a long prefill"
    assert runner.eager["eager_prefills"] == eager + 1  # counted as an eager prefill
    at_once = runner.forward([SeqInput(token_ids=tokens[:30], start=0, block_table=list(range(50, 58)))]).clone()  # fmt: skip
    for t in range(30):
        one = runner.forward([SeqInput(token_ids=[tokens[t]], start=t, block_table=list(range(60, 68)))])  # fmt: skip
    assert torch.equal(at_once, alone) and torch.equal(one, alone)


def test_the_invariant_runner_computes_the_default_runners_logits():
    """Same model, same math: the mode's logits are the default (compiled, cuBLAS) runner's
    up to fp32 rounding, and a float64 CPU runner's."""
    from test_model_runner import make_runner

    runner = invariant_runner(torch.float32, graphs=False, max_seq_len=64)
    torch.manual_seed(0)
    default = ModelRunner(
        tiny_qwen3(), num_blocks=160, block_size=4, max_seq_len=64, device="cuda",
        dtype=torch.float32,
    )  # fmt: skip
    exact = make_runner(tiny_qwen3(), num_blocks=160, max_seq_len=64, dtype=torch.float64)
    batch = [
        SeqInput(token_ids=list(range(1, 20)), start=0, block_table=[0, 1, 2, 3, 4]),
        SeqInput(token_ids=list(range(30, 33)), start=0, block_table=[9]),
    ]
    got = runner.forward(batch).cpu()
    torch.testing.assert_close(got, default.forward(batch).cpu(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, exact.forward(batch), atol=1e-4, rtol=1e-4)


def test_invariant_kernels_give_each_row_its_bits_at_the_06b_shapes():
    """The Qwen3-0.6B projections (bf16) and norms, and the sampler's scans: any number of
    rows (1 to 2,048, tile edges), any slice, the same bits per row; and float64 numerics."""
    from torchtitan_rl.generation import invariant_kernels as ik

    gen = torch.Generator(device="cuda").manual_seed(0)
    x_ME = torch.randn(2048, 1024, device="cuda", generator=gen).bfloat16()
    for N, K in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)):
        w_NK = (torch.randn(N, K, device="cuda", generator=gen) / K**0.5).bfloat16()
        x_MK = x_ME if K == 1024 else torch.randn(2048, K, device="cuda", generator=gen).bfloat16()
        full = ik.linear(x_MK, w_NK)
        for lo, hi in ((0, 1), (1, 2), (5, 12), (60, 129), (100, 356), (2047, 2048)):
            assert torch.equal(ik.linear(x_MK[lo:hi], w_NK), full[lo:hi]), (N, K, lo, hi)
        want = x_MK[:64].double() @ w_NK.double().T
        torch.testing.assert_close(full[:64].double(), want, atol=0.05, rtol=0.01)
    norm = torch.nn.RMSNorm(1024, eps=1e-6).to("cuda", torch.bfloat16)
    y = ik.rms_norm(norm, x_ME)
    for lo, hi in ((0, 1), (3, 70), (2000, 2048)):
        assert torch.equal(ik.rms_norm(norm, x_ME[lo:hi]), y[lo:hi])
    torch.testing.assert_close(y.float(), norm(x_ME).float(), atol=0.02, rtol=0.02)
    probs_RV = torch.rand(64, 151936, device="cuda", generator=gen, dtype=torch.float64)
    c = ik.row_cumsum(probs_RV)
    torch.testing.assert_close(c, probs_RV.cumsum(-1), atol=1e-9, rtol=1e-12)
    for lo, hi in ((0, 1), (7, 8), (10, 40)):
        assert torch.equal(ik.row_cumsum(probs_RV[lo:hi]), c[lo:hi])


def test_batch_invariant_key_switches_the_kernels_and_needs_the_paged_attention():
    engine = cuda_engine("tiny-fp32", max_num_seqs=2)
    assert engine.runner.invariant_kernels and engine.runner.batch_invariant
    assert engine.runner.decode_graphs is not None and engine.runner.mixed_graphs is not None
    assert isinstance(engine.runner._layer_qkv, functools.partial)  # not torch.compile'd
    off = cuda_engine("tiny-fp32", max_num_seqs=2, batch_invariant=False)
    assert not off.runner.invariant_kernels and not off.runner.batch_invariant
    with pytest.raises(ValueError, match='batch_invariant on CUDA needs generator.decode_attention "auto" or "triton"'):  # fmt: skip
        cuda_engine("tiny-fp32", decode_attention="gather")
