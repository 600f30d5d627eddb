import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from torchtitan_rl.generation.keyed_random import keyed_uniform, seed_keys
from torchtitan_rl.generation.sampling import RowPlan, sample_tokens, sampling_logprobs

# Near a top-p cut the fp32 and fp64 cumulative sums may disagree; such cases are skipped.
CUT_MARGIN = 1e-5


def reference_distribution(logits, temperature, top_p, top_k):
    """float64 reference: (probs over the vocab, kept ids ascending, whether a cut was close)."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        p = np.exp(logits - logits.max())
        return p / p.sum(), np.arange(len(logits)), False
    z = logits / temperature
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    if top_k > 0:
        order = order[:top_k]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    kept, mass, close = [], 0.0, False
    for idx, prob in zip(order, p):
        if kept and top_p < 1:
            close |= abs(mass - top_p) < CUT_MARGIN
            if mass >= top_p:
                break
        kept.append(idx)
        mass += prob
    probs = np.zeros(len(z))
    zk = z[kept]
    probs[kept] = np.exp(zk - zk.max()) / np.exp(zk - zk.max()).sum()
    return probs, np.array(sorted(kept)), close


def params(n, temperature=1.0, top_p=1.0, top_k=0):
    return dict(
        temperature_N=torch.full((n,), float(temperature)),
        top_p_N=torch.full((n,), float(top_p)),
        top_k_N=torch.full((n,), int(top_k)),
    )


def draws(*seeds, position=0, device="cpu"):
    """The rows' random draws: U(seed, position) for each seed."""
    return dict(
        key_N=seed_keys(seeds, device),
        position_N=torch.full((len(seeds),), position, dtype=torch.long, device=device),
    )


# ids 0..3 shuffled so that "sorted ascending" differs from "most likely first"
HAND_PROBS = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}
HAND_LOGITS = torch.tensor([[math.log(HAND_PROBS[i]) for i in range(4)]])


@pytest.mark.parametrize(
    "top_p, top_k, expected",
    [
        (1.0, 0, [0, 1, 2, 3]),
        (0.45, 0, [2]),
        (0.55, 0, [0, 2]),
        (0.85, 0, [0, 2, 3]),
        (1.0, 1, [2]),
        (1.0, 3, [0, 2, 3]),
        (0.6, 3, [0, 2]),  # top-3 renormalised: 0.526, 0.316, 0.158 -> nucleus of two
        (0.01, 3, [2]),
    ],
)
def test_support_on_hand_made_logits(top_p, top_k, expected):
    out = sample_tokens(
        HAND_LOGITS,
        **params(1, 1.0, top_p, top_k),
        **draws(0),
        return_support=True,
    )
    assert out.support[0].dtype == torch.int32
    assert out.support[0].tolist() == expected
    assert out.token_ids_N.item() in expected


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(1, 40),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_p=st.sampled_from([1.0, 0.95, 0.7, 0.3, 0.05]),
    top_k=st.integers(0, 45),
)
def test_logprobs_equal_log_of_renormalised_reference(seed, vocab, temperature, top_p, top_k):
    logits_V = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3
    probs, kept, close = reference_distribution(logits_V.numpy(), temperature, top_p, top_k)
    assume(not close)
    logprobs_NV, keep_NV = sampling_logprobs(logits_V[None], **params(1, temperature, top_p, top_k))
    assert keep_NV[0].nonzero().squeeze(1).tolist() == kept.tolist()
    with np.errstate(divide="ignore"):
        ref = np.log(probs)
    np.testing.assert_allclose(logprobs_NV[0].double().numpy(), ref, atol=1e-5, rtol=1e-5)

    out = sample_tokens(logits_V[None], **params(1, temperature, top_p, top_k), **draws(seed))
    token = out.token_ids_N.item()
    assert token in kept
    assert out.logprobs_N.item() == pytest.approx(ref[token], abs=1e-5)


def test_greedy_picks_argmax_and_scores_at_temperature_one_ignoring_filters():
    logits_NV = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    out = sample_tokens(
        logits_NV,
        **params(5, temperature=0.0, top_p=0.1, top_k=2),
        **draws(*range(5)),
        return_support=True,
    )
    assert out.token_ids_N.tolist() == logits_NV.argmax(-1).tolist()
    expected = torch.log_softmax(logits_NV.double(), -1).max(-1).values
    torch.testing.assert_close(out.logprobs_N.double(), expected, atol=1e-6, rtol=0)
    assert all(s.tolist() == list(range(30)) for s in out.support)


def test_same_seed_gives_same_tokens_whatever_the_batch_composition():
    logits_V = torch.randn(50, generator=torch.Generator().manual_seed(3))
    others = torch.randn(4, 50, generator=torch.Generator().manual_seed(4))
    for step in range(20):
        alone = sample_tokens(logits_V[None], **params(1, 0.9, 0.9, 20), **draws(7, position=step))
        # the tracked row moves around inside batches of different sizes and settings, beside
        # rows at other positions
        pos = step % 4
        batch_NV = torch.cat([others[:pos], logits_V[None], others[pos:]])
        seeds, positions = list(range(100 + step, 104 + step)), [3 * step, 0, 5, step + 1]
        temps, top_ps, top_ks = [0.0, 0.5, 1.3, 2.0], [1.0, 0.5, 0.99, 0.2], [0, 3, 0, 40]
        for values, mine in (
            (temps, 0.9),
            (top_ps, 0.9),
            (top_ks, 20),
            (seeds, 7),
            (positions, step),
        ):
            values.insert(pos, mine)
        batch = sample_tokens(
            batch_NV,
            temperature_N=torch.tensor(temps),
            top_p_N=torch.tensor(top_ps),
            top_k_N=torch.tensor(top_ks),
            key_N=seed_keys(seeds),
            position_N=torch.tensor(positions),
        )
        assert batch.token_ids_N[pos].item() == alone.token_ids_N.item()
        assert batch.logprobs_N[pos].item() == alone.logprobs_N.item()


def test_a_sampled_token_is_the_inverse_cdf_of_its_keyed_draw():
    """Row i's token is the first id whose float64 cumulative probability exceeds
    U(seed_i, p) times the total (the draw of `keyed_random`, nothing else)."""
    logits_NV = torch.randn(64, 30, generator=torch.Generator().manual_seed(6)) * 2
    seeds = list(range(900, 964))
    for position in (0, 1, 17):
        out = sample_tokens(logits_NV, **params(64, 0.8), **draws(*seeds, position=position))
        u_N = keyed_uniform(seed_keys(seeds), torch.full((64,), position)).double()
        cdf_NV = torch.softmax(logits_NV.double() / 0.8, dim=-1).cumsum(-1)
        want_N = (cdf_NV <= u_N[:, None] * cdf_NV[:, -1:]).sum(-1)
        assert out.token_ids_N.tolist() == want_N.tolist()


def test_sampled_frequencies_match_the_distribution_chi_square():
    """2000 rows x 10 positions of a 6-token vocabulary at temperature 0.7, top-k 4: the
    counts of the kept tokens pass a chi-square test at p = 0.001 (the draws are fixed, so
    the test is deterministic), and the two cut tokens never come."""
    logits_V = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature, top_k, rows, calls = 0.7, 4, 2000, 10
    probs, _, _ = reference_distribution(logits_V.numpy(), temperature, 1.0, top_k)
    counts = np.zeros(6)
    for position in range(calls):
        out = sample_tokens(
            logits_V.expand(rows, 6),
            **params(rows, temperature, 1.0, top_k),
            **draws(*range(rows), position=position),
        )
        counts += np.bincount(out.token_ids_N.numpy(), minlength=6)
    assert counts[4] == counts[5] == 0
    expected = probs[:4] * rows * calls
    chi2 = float(((counts[:4] - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (chi2, counts)  # chi-square quantile at 0.999, 3 degrees of freedom


@pytest.mark.parametrize(
    "temps, top_ps, top_ks",
    [
        ([0.0, 0.5, 1.3, 2.0, 1.0], [1.0, 0.5, 0.99, 0.2, 1.0], [0, 3, 0, 40, 0]),
        ([1.0, 0.7, 1.0], [1.0, 1.0, 1.0], [0, 0, 0]),  # nothing filters: no mask
        ([0.0, 0.0], [0.3, 1.0], [5, 0]),  # greedy rows ignore their filters
        ([0.8, 1.0, 1.2], [0.9, 0.5, 0.7], [0, 0, 0]),  # every row cuts by top-p alone
        ([0.8, 1.0, 1.2], [1.0, 1.0, 1.0], [3, 10, 1]),  # every row cuts by top-k alone
        ([1.0, 0.9, 0.0, 1.1], [0.6, 1.0, 1.0, 0.8], [0, 0, 7, 0]),  # top-p rows and others
        # temperatures float32 holds as 0 are greedy, as the tensors say
        ([1e-300, 1.0, 0.7], [1.0, 1.0, 0.9], [0, 0, 0]),
        ([1e-46, 0.0, 1.0], [1.0, 0.5, 1.0], [0, 0, 3]),
    ],
)
def test_host_plan_gives_the_same_tokens_logprobs_and_supports(temps, top_ps, top_ks):
    """The plan's shortcuts (no row selection when every row filters or samples, no top-k
    or top-p cut that no row makes) give the bits of the sampler that finds the rows on
    the device."""
    n = len(temps)
    logits_NV = torch.randn(n, 60, generator=torch.Generator().manual_seed(5))
    rows = dict(
        temperature_N=torch.tensor(temps),
        top_p_N=torch.tensor(top_ps),
        top_k_N=torch.tensor(top_ks),
    )
    plan = RowPlan.of(temps, top_ps, top_ks)
    assert plan.sampled_rows == rows["temperature_N"].gt(0).nonzero().squeeze(1).tolist()
    for position in range(5):
        keyed = draws(*range(n), position=position)
        planned = sample_tokens(logits_NV, **rows, **keyed, return_support=True, plan=plan)
        plain = sample_tokens(logits_NV, **rows, **keyed, return_support=True)
        assert torch.equal(planned.token_ids_N, plain.token_ids_N)
        assert torch.equal(planned.logprobs_N, plain.logprobs_N)
        assert all(torch.equal(a, b) for a, b in zip(planned.support, plain.support))


def test_mismatched_row_params_are_rejected():
    with pytest.raises(ValueError, match="per row"):
        sample_tokens(torch.zeros(2, 5), **params(2), **draws(0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [7, 5000, 151936])
def test_fused_full_vocabulary_kernel_matches_the_reference_sampler(vocab):
    """On CUDA, rows with temperature > 0 and no top-k/top-p take the fused kernel; the
    reference path (no plan) must draw the same tokens with the same log-probs."""
    n = 96
    g = torch.Generator().manual_seed(vocab)
    logits_NV = (torch.randn(n, vocab, generator=g) * 4).cuda()
    temps = (torch.rand(n, generator=g) * 1.5 + 0.2).tolist()
    rows = dict(
        temperature_N=torch.tensor(temps).cuda(),
        top_p_N=torch.ones(n).cuda(),
        top_k_N=torch.zeros(n, dtype=torch.long).cuda(),
    )
    plan = RowPlan.of(temps, [1.0] * n, [0] * n)
    for position in range(3):
        keyed = draws(*range(n), position=position, device="cuda")
        fused = sample_tokens(logits_NV, **rows, **keyed, plan=plan)
        reference = sample_tokens(logits_NV, **rows, **keyed)
        assert torch.equal(fused.token_ids_N, reference.token_ids_N)
        torch.testing.assert_close(fused.logprobs_N, reference.logprobs_N, atol=1e-5, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_cuda_samples_the_cpu_tokens_from_the_same_logits(top_p):
    """The same logits and seeds on CPU and on CUDA (fused kernel at top-p 1, the masked
    reference path at 0.9) give the same tokens, log-probs within fp32 rounding."""
    n, vocab = 64, 3000
    g = torch.Generator().manual_seed(11)
    logits_NV = torch.randn(n, vocab, generator=g) * 3
    temps = (torch.rand(n, generator=g) + 0.3).tolist()
    plan = RowPlan.of(temps, [top_p] * n, [0] * n)
    for position in (0, 1, 40):
        out = {}
        for device in ("cpu", "cuda"):
            out[device] = sample_tokens(
                logits_NV.to(device),
                temperature_N=torch.tensor(temps, device=device),
                top_p_N=torch.full((n,), top_p, device=device),
                top_k_N=torch.zeros(n, dtype=torch.long, device=device),
                **draws(*range(n), position=position, device=device),
                plan=plan,
            )
        assert out["cuda"].token_ids_N.cpu().tolist() == out["cpu"].token_ids_N.tolist()
        torch.testing.assert_close(
            out["cuda"].logprobs_N.cpu(), out["cpu"].logprobs_N, atol=1e-5, rtol=1e-6
        )
