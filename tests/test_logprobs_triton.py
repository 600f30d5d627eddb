"""The Triton path of token_logprobs against a float64 reference, gradients included.

Reference (written independently of the kernels): z = h W^T / temperature in float64,
logprob = log_softmax(z)[target], entropy = -sum softmax(z) * log_softmax(z); gradients of
loss = sum(a * logprob + b * entropy) for random a, b.
GPU tests need CUDA; the interpreter test runs the same kernels on CPU (TRITON_INTERPRET=1)
in float32 (the interpreter's bf16 tl.dot is wrong on Triton 3.9, the compiled one is not).
Shape suffixes: N = tokens, D = hidden size, V = vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted

from torchtitan_rl.losses.logprobs import token_logprobs

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def reference(hidden_ND, weight_VD, targets_N, temperature):
    z_NV = hidden_ND.double() @ weight_VD.double().T / temperature
    logp_NV = torch.log_softmax(z_NV, dim=-1)
    return logp_NV.gather(1, targets_N[:, None]).squeeze(1), -(logp_NV.exp() * logp_NV).sum(-1)


def make_inputs(n, d, v, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden_ND = torch.randn(n, d, generator=gen, dtype=torch.float64)
    weight_VD = torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5 * 3
    targets_N = torch.randint(0, v, (n,), generator=gen)
    coef_a_N = torch.randn(n, generator=gen, dtype=torch.float64)
    coef_b_N = torch.randn(n, generator=gen, dtype=torch.float64)
    return [
        t.to(device)
        for t in (hidden_ND.to(dtype), weight_VD.to(dtype), targets_N, coef_a_N, coef_b_N)
    ]


def values_and_grads(fn, hidden_ND, weight_VD, coef_a_N, coef_b_N):
    hidden_ND = hidden_ND.detach().requires_grad_()
    weight_VD = weight_VD.detach().requires_grad_()
    logprobs_N, entropy_N = fn(hidden_ND, weight_VD)
    loss = (coef_a_N * logprobs_N.double() + coef_b_N * entropy_N.double()).sum()
    return (logprobs_N, entropy_N, *torch.autograd.grad(loss, (hidden_ND, weight_VD)))


def assert_matches_reference(fn, hidden, weight, targets, a, b, temperature, rel):
    got = values_and_grads(fn, hidden, weight, a, b)
    want = values_and_grads(
        lambda h, w: reference(h, w, targets, temperature), hidden.double(), weight.double(), a, b
    )
    names = ("logprobs", "entropy", "grad_hidden", "grad_weight")
    for name, g, w in zip(names, got, want):
        assert g.dtype == (torch.float32 if name in names[:2] else hidden.dtype), name
        err = ((g.double() - w).norm() / w.norm().clamp(min=1e-12)).item()
        assert err < rel, f"{name}: relative error {err:.2e} >= {rel:.0e}"


def check_interpreted() -> None:
    """Runs in a child process with TRITON_INTERPRET=1 set before triton is first imported
    (the interpreter cannot run kernels whose triton.language was imported compiled)."""
    from torchtitan_rl.losses import logprobs_triton as kernels

    # Small tiles and a small gradient buffer: ragged row, vocab and hidden tiles, and
    # several vocabulary chunks with a ragged last one.
    kernels.FORWARD_TILES = kernels.TileConfig(block_n=16, block_v=32, block_k=16)
    kernels.BACKWARD_TILES = kernels.TileConfig(block_n=16, block_v=32, block_k=16, group_n=2)
    kernels.CHUNK_ALIGN = 32
    kernels.DLOGITS_BUFFER_BYTES = 37 * 96 * 4
    hidden, weight, targets, a, b = make_inputs(37, 40, 301, torch.float32, "cpu")
    fn = lambda h, w: kernels.token_logprobs(h, w, targets, temperature=0.7)  # noqa: E731
    assert_matches_reference(fn, hidden, weight, targets, a, b, 0.7, rel=1e-5)


# ---- CPU: the kernels under the Triton interpreter -------------------------------------
def test_interpreted_kernels_match_float64_reference_with_ragged_tiles():
    run_interpreted("test_logprobs_triton")


# ---- GPU --------------------------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("n", "d", "v", "temperature"),
    # D = 100 in bf16 rows are 200 bytes: no copy-engine descriptor, pointer loads instead.
    [(300, 96, 1000, 0.7), (257, 100, 4099, 1.0), (1, 64, 130, 1.3), (129, 1024, 151936, 1.0)],
)
@pytest.mark.parametrize(("dtype", "rel"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_triton_matches_float64_reference(n, d, v, temperature, dtype, rel):
    from torchtitan_rl.losses import logprobs_triton

    hidden, weight, targets, a, b = make_inputs(n, d, v, dtype, "cuda")
    fn = lambda h, w: logprobs_triton.token_logprobs(  # noqa: E731
        h, w, targets, temperature=temperature
    )
    assert_matches_reference(fn, hidden, weight, targets, a, b, temperature, rel)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "tiles",
    [
        dict(tma=False), dict(maxnreg=128), dict(block_v=256), dict(block_n=256),
        dict(num_stages=4), dict(block_n=64, num_warps=4, num_stages=4),
    ],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_tile_configs_match_reference(monkeypatch, tiles, dtype):
    from torchtitan_rl.losses import logprobs_triton

    config = logprobs_triton.TileConfig(**tiles)
    monkeypatch.setattr(logprobs_triton, "FORWARD_TILES", config)
    monkeypatch.setattr(logprobs_triton, "BACKWARD_TILES", config)
    hidden, weight, targets, a, b = make_inputs(257, 200, 4099, dtype, "cuda")
    fn = lambda h, w: logprobs_triton.token_logprobs(h, w, targets, temperature=0.9)  # noqa: E731
    rel = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert_matches_reference(fn, hidden, weight, targets, a, b, 0.9, rel)


@gpu
@needs_cuda
def test_triton_several_vocab_chunks_match_reference(monkeypatch):
    from torchtitan_rl.losses import logprobs_triton

    # 700 rows x 1024 ids of bf16 per chunk: 5 chunks over V = 4500, the last one ragged.
    monkeypatch.setattr(logprobs_triton, "DLOGITS_BUFFER_BYTES", 700 * 1024 * 2)
    hidden, weight, targets, a, b = make_inputs(700, 256, 4500, torch.bfloat16, "cuda")
    fn = lambda h, w: logprobs_triton.token_logprobs(h, w, targets)  # noqa: E731
    assert_matches_reference(fn, hidden, weight, targets, a, b, 1.0, rel=1e-2)


@gpu
@needs_cuda
def test_triton_grads_exact_for_logprob_only_entropy_only_and_without_entropy():
    from torchtitan_rl.losses import logprobs_triton

    hidden, weight, targets, a, b = make_inputs(200, 64, 3000, torch.float32, "cuda")
    for coef_a, coef_b in ((a, 0 * b), (0 * a, b)):
        fn = lambda h, w: logprobs_triton.token_logprobs(h, w, targets)  # noqa: E731
        assert_matches_reference(fn, hidden, weight, targets, coef_a, coef_b, 1.0, rel=1e-5)
    h = hidden.clone().requires_grad_()
    lp, ent = logprobs_triton.token_logprobs(h, weight, targets, with_entropy=False)
    assert ent is None
    (grad_h,) = torch.autograd.grad((a * lp.double()).sum(), (h,))
    hd = hidden.double().requires_grad_()
    (want,) = torch.autograd.grad(
        (a * reference(hd, weight.double(), targets, 1.0)[0]).sum(), (hd,)
    )
    torch.testing.assert_close(
        lp.double(), reference(hidden, weight, targets, 1.0)[0], rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(grad_h.double(), want, rtol=1e-4, atol=1e-6)


@gpu
@needs_cuda
def test_token_logprobs_on_cuda_dispatches_to_triton_and_keeps_float64_dense():
    from torchtitan_rl.losses import logprobs_triton

    hidden, weight, targets, _, _ = make_inputs(64, 32, 500, torch.bfloat16, "cuda")
    got = token_logprobs(hidden, weight, targets, temperature=0.8)
    want = logprobs_triton.token_logprobs(hidden, weight, targets, temperature=0.8)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    hidden64, weight64 = hidden.double(), weight.double()
    lp, ent = token_logprobs(hidden64, weight64, targets)  # float64 takes the chunked path
    ref_lp, ref_ent = reference(hidden64, weight64, targets, 1.0)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
