"""token_logprobs against a float64 reference that materialises the full logits.

Reference: z = h W^T / temperature (masked to -inf outside the support, when given),
logprob = log_softmax(z)[target], entropy = -sum softmax(z) * log_softmax(z).
Gradients are checked for loss = sum(a * logprob + b * entropy) with random a, b.
Shape suffixes: N = tokens, D = hidden size, V = vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from torchtitan_rl.losses.logprobs import token_logprobs


def reference(hidden_ND, weight_VD, targets_N, temperature, allowed_NV=None):
    z_NV = hidden_ND.double() @ weight_VD.double().T / temperature
    if allowed_NV is not None:
        z_NV = z_NV.masked_fill(~allowed_NV, float("-inf"))
    logp_NV = torch.log_softmax(z_NV, dim=-1)
    logprobs_N = logp_NV.gather(1, targets_N[:, None]).squeeze(1)
    # Excluded ids have p = 0 and log p = -inf; 0 * -inf would turn the gradient into NaN.
    finite_logp_NV = torch.where(torch.isfinite(logp_NV), logp_NV, 0.0)
    entropy_N = -(logp_NV.exp() * finite_logp_NV).sum(-1)
    return logprobs_N, entropy_N


def assert_close_in_norm(got, want, rel):
    """Low-precision check: bf16 logits carry ~1e-2 relative error, so bound the error norm."""
    err = (got.double() - want).norm() / want.norm().clamp(min=1e-12)
    assert err < rel, f"relative error {err:.2e} >= {rel:.0e}"


def make_inputs(n, d, v, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden_ND = torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype)
    weight_VD = (torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5 * 3).to(dtype)
    targets_N = torch.randint(0, v, (n,), generator=gen)
    coef_a_N = torch.randn(n, generator=gen, dtype=torch.float64)
    coef_b_N = torch.randn(n, generator=gen, dtype=torch.float64)
    return hidden_ND, weight_VD, targets_N, coef_a_N, coef_b_N


def grads_of(fn, hidden_ND, weight_VD, coef_a_N, coef_b_N, *, upcast=False):
    if upcast:  # the reference differentiates float64 copies of the inputs
        hidden_ND, weight_VD = hidden_ND.double(), weight_VD.double()
    hidden_ND = hidden_ND.detach().requires_grad_()
    weight_VD = weight_VD.detach().requires_grad_()
    logprobs_N, entropy_N = fn(hidden_ND, weight_VD)
    loss = (coef_a_N * logprobs_N.double() + coef_b_N * entropy_N.double()).sum()
    grad_h, grad_w = torch.autograd.grad(loss, (hidden_ND, weight_VD))
    return logprobs_N, entropy_N, grad_h, grad_w


@pytest.mark.parametrize(
    ("n", "d", "v", "chunk_size", "temperature"),
    [(37, 16, 101, 8, 0.7), (64, 8, 53, 64, 1.0), (5, 12, 257, 1024, 1.3), (1, 4, 7, 3, 0.7)],
)
def test_dense_matches_float64_reference_values_and_grads(n, d, v, chunk_size, temperature):
    hidden, weight, targets, a, b = make_inputs(n, d, v, torch.float64)
    out = grads_of(
        lambda h, w: token_logprobs(h, w, targets, temperature=temperature, chunk_size=chunk_size),
        hidden, weight, a, b,
    )  # fmt: skip
    ref = grads_of(lambda h, w: reference(h, w, targets, temperature), hidden, weight, a, b)
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("dtype", "rel"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_low_precision_inputs_give_fp32_outputs_and_input_dtype_grads(dtype, rel):
    hidden, weight, targets, a, b = make_inputs(29, 16, 77, dtype)
    lp, ent, grad_h, grad_w = grads_of(
        lambda h, w: token_logprobs(h, w, targets, temperature=0.7, chunk_size=8),
        hidden, weight, a, b,
    )  # fmt: skip
    ref = grads_of(lambda h, w: reference(h, w, targets, 0.7), hidden, weight, a, b, upcast=True)
    assert lp.dtype == ent.dtype == torch.float32
    assert grad_h.dtype == grad_w.dtype == dtype
    for got, want in zip((lp, ent, grad_h, grad_w), ref):
        assert_close_in_norm(got, want, rel)


def test_grads_exact_when_only_logprobs_or_only_entropy_is_used():
    hidden, weight, targets, a, b = make_inputs(19, 8, 31, torch.float64)
    for coef_a, coef_b in ((a, torch.zeros_like(b)), (torch.zeros_like(a), b)):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        lp, ent = token_logprobs(h, w, targets, chunk_size=4)
        used = lp if coef_b.abs().sum() == 0 else ent
        coef = coef_a if coef_b.abs().sum() == 0 else coef_b
        got = torch.autograd.grad((coef * used).sum(), (h, w))
        ref = grads_of(lambda h, w: reference(h, w, targets, 1.0), hidden, weight, coef_a, coef_b)
        torch.testing.assert_close(got[0], ref[2])
        torch.testing.assert_close(got[1], ref[3])


def test_without_entropy_returns_none_and_exact_logprob_grads():
    hidden, weight, targets, a, _ = make_inputs(13, 8, 29, torch.float64)
    h = hidden.clone().requires_grad_()
    lp, ent = token_logprobs(h, weight, targets, with_entropy=False, chunk_size=5)
    assert ent is None
    (grad_h,) = torch.autograd.grad((a * lp).sum(), (h,))
    ref = grads_of(lambda h, w: reference(h, w, targets, 1.0), hidden, weight, a, 0 * a)
    torch.testing.assert_close(lp, ref[0])
    torch.testing.assert_close(grad_h, ref[2])


def test_dense_path_passes_gradcheck():
    hidden, weight, targets, _, _ = make_inputs(6, 4, 11, torch.float64)
    hidden.requires_grad_()
    weight.requires_grad_()
    fn = lambda h, w: token_logprobs(h, w, targets, temperature=0.7, chunk_size=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight))


def csr(rows_of_ids, v):
    ids = [i for row in rows_of_ids for i in row]
    offsets = [0]
    for row in rows_of_ids:
        offsets.append(offsets[-1] + len(row))
    allowed_NV = torch.zeros(len(rows_of_ids), v, dtype=torch.bool)
    for n, row in enumerate(rows_of_ids):
        allowed_NV[n, row] = True
        if not row:
            allowed_NV[n] = True
    support = (torch.tensor(ids, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32))
    return support, allowed_NV


def random_support(targets_N, v, seed):
    """Rows: some empty (full vocabulary), some missing their target, some with duplicates."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n, target in enumerate(targets_N.tolist()):
        if n % 4 == 0:
            rows.append([])
            continue
        ids = torch.randperm(v, generator=gen)[: 1 + n % 7].tolist()
        if n % 4 == 1:
            ids = [i for i in ids if i != target] or [(target + 1) % v]
        if n % 4 == 2:
            ids = ids + [target, target]
        rows.append(ids)
    return rows


def test_support_matches_masked_float64_reference_including_missing_targets():
    hidden, weight, targets, a, b = make_inputs(23, 8, 41, torch.float64)
    rows = random_support(targets, 41, seed=1)
    support, allowed = csr(rows, 41)
    allowed[torch.arange(23), targets] = True  # the target always joins its support
    out = grads_of(
        lambda h, w: token_logprobs(h, w, targets, temperature=0.7, chunk_size=4, support=support),
        hidden, weight, a, b,
    )  # fmt: skip
    ref = grads_of(lambda h, w: reference(h, w, targets, 0.7, allowed), hidden, weight, a, b)
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_support_target_outside_support_is_added_to_it():
    hidden, weight, _, _, _ = make_inputs(1, 4, 9, torch.float64)
    targets = torch.tensor([3])
    support, _ = csr([[0, 5]], 9)
    lp, ent = token_logprobs(hidden, weight, targets, support=support)
    z = hidden[0] @ weight.T
    z_kept = z[[0, 3, 5]]
    torch.testing.assert_close(lp, (z[3] - torch.logsumexp(z_kept, 0))[None])
    p = torch.softmax(z_kept, 0)
    torch.testing.assert_close(ent, -(p * p.log()).sum()[None])


def test_support_with_only_the_target_gives_zero_logprob_and_entropy():
    hidden, weight, _, _, _ = make_inputs(2, 4, 9, torch.float64)
    support, _ = csr([[4], [2]], 9)
    lp, ent = token_logprobs(hidden, weight, torch.tensor([4, 2]), support=support)
    torch.testing.assert_close(lp, torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(ent, torch.zeros(2, dtype=torch.float64))


def test_empty_support_everywhere_equals_full_vocabulary():
    hidden, weight, targets, _, _ = make_inputs(7, 8, 19, torch.float64)
    support, _ = csr([[] for _ in range(7)], 19)
    got = token_logprobs(hidden, weight, targets, temperature=0.7, support=support)
    want = token_logprobs(hidden, weight, targets, temperature=0.7)
    torch.testing.assert_close(got, want)


def test_support_bf16_is_close_to_reference_with_bf16_grads():
    hidden, weight, targets, a, b = make_inputs(17, 16, 37, torch.bfloat16)
    support, allowed = csr(random_support(targets, 37, seed=2), 37)
    allowed[torch.arange(17), targets] = True
    lp, ent, grad_h, grad_w = grads_of(
        lambda h, w: token_logprobs(h, w, targets, chunk_size=4, support=support),
        hidden, weight, a, b,
    )  # fmt: skip
    assert lp.dtype == torch.float32 and grad_h.dtype == grad_w.dtype == torch.bfloat16
    ref = grads_of(
        lambda h, w: reference(h, w, targets, 1.0, allowed), hidden, weight, a, b, upcast=True
    )
    for got, want in zip((lp, ent, grad_h, grad_w), ref):
        assert_close_in_norm(got, want, 1e-2)


def test_bad_inputs_raise_value_errors_naming_the_argument():
    hidden, weight, targets, _, _ = make_inputs(3, 4, 5, torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="targets_N"):
        token_logprobs(hidden, weight, targets[:2])
    with pytest.raises(ValueError, match="offsets"):
        token_logprobs(hidden, weight, targets, support=(torch.tensor([1]), torch.tensor([0, 1])))
    with pytest.raises(ValueError, match="support ids"):
        bad = (torch.tensor([7]), torch.tensor([0, 1, 1, 1]))
        token_logprobs(hidden, weight, targets, support=bad)
