"""Counter-based draws U(seed, p) (generation/keyed_random.py): the bits of a Python-integer
SplitMix64, the same on every device, on the host (numpy) and in every batch, uniform in [0, 1) (Kolmogorov-
Smirnov and chi-square over 1e5 fixed draws, along a request's positions and across
neighbouring seeds), and no correlation between neighbouring positions or seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torchtitan_rl.generation.keyed_random import (
    MASK64,
    host_seed_keys,
    host_uniform,
    keyed_uniform,
    seed_keys,
)

N_DRAWS = 100_000
KS_CRITICAL = 1.949 / math.sqrt(N_DRAWS)
"""Kolmogorov-Smirnov statistic a uniform sample of N_DRAWS exceeds with probability 0.001."""


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Chi-square quantile (Wilson-Hilferty), z = 3.09: exceeded with probability 0.001."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _mix(x: int, s1: int, m1: int, s2: int, m2: int, s3: int) -> int:
    x ^= x >> s1
    x = (x * m1) & MASK64
    x ^= x >> s2
    x = (x * m2) & MASK64
    return x ^ (x >> s3)


def reference_uniform(seed: int, position: int) -> float:
    """SplitMix64 output `position` from state fmix64(seed), in Python integers."""
    gamma = 0x9E3779B97F4A7C15
    key = _mix(seed & MASK64, 33, 0xFF51AFD7ED558CCD, 33, 0xC4CEB9FE1A85EC53, 33)
    x = _mix((key + (position + 1) * gamma) & MASK64, 30, 0xBF58476D1CE4E5B9, 27,
             0x94D049BB133111EB, 31)  # fmt: skip
    return (x >> 11) * 2.0**-53


SEEDS = [0, 1, 2, 7, 2**31 - 1, 2**62 + 12345, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**40), 2**70 + 3]
POSITIONS = [0, 1, 2, 63, 64, 1000, 2**20, 2**40 + 7]


def grid(device: str = "cpu") -> tuple[list[tuple[int, int]], torch.Tensor]:
    pairs = [(s, p) for s in SEEDS for p in POSITIONS]
    key_N = seed_keys([s for s, _ in pairs], device)
    position_N = torch.tensor([p for _, p in pairs], device=device)
    return pairs, keyed_uniform(key_N, position_N)


def test_draws_are_the_bits_of_python_integer_splitmix64():
    pairs, uniform_N = grid()
    assert uniform_N.dtype == torch.float64
    assert uniform_N.tolist() == [reference_uniform(s, p) for s, p in pairs]
    # seeds are taken modulo 2**64
    assert seed_keys([-1]).item() == seed_keys([2**64 - 1]).item()


def test_host_draws_are_the_same_bits():
    """numpy's uint64 hash (the engine's: `host_uniform`) gives the tensor ops' bits."""
    pairs, uniform_N = grid()
    keys = host_seed_keys([s for s, _ in pairs])
    assert keys.dtype == np.uint64
    assert np.array_equal(keys.view(np.int64), seed_keys([s for s, _ in pairs]).numpy())
    positions = np.array([p for _, p in pairs], dtype=np.int64)
    out = np.empty(len(pairs))
    assert host_uniform(keys, positions, out_N=out) is out
    assert out.tolist() == uniform_N.tolist()
    big = keyed_uniform(seed_keys(range(N_DRAWS)), torch.arange(N_DRAWS) * 977).numpy()
    assert np.array_equal(
        host_uniform(host_seed_keys(range(N_DRAWS)), np.arange(N_DRAWS) * 977), big
    )


def test_a_rows_draw_does_not_depend_on_its_batch():
    pairs, uniform_N = grid()
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0))[:40]
    shuffled = keyed_uniform(
        seed_keys([pairs[i][0] for i in order]), torch.tensor([pairs[i][1] for i in order])
    )
    assert torch.equal(shuffled, uniform_N[order])
    for i in order[:5].tolist():
        alone = keyed_uniform(seed_keys([pairs[i][0]]), torch.tensor([pairs[i][1]]))
        assert alone.item() == uniform_N[i].item()


def draws_along_positions() -> np.ndarray:
    return keyed_uniform(seed_keys([12345] * N_DRAWS), torch.arange(N_DRAWS)).numpy()


def draws_across_seeds() -> np.ndarray:
    return keyed_uniform(seed_keys(range(N_DRAWS)), torch.zeros(N_DRAWS, dtype=torch.long)).numpy()


@pytest.mark.parametrize("draws", [draws_along_positions, draws_across_seeds])
def test_draws_are_uniform_in_the_unit_interval(draws):
    u = np.sort(draws())
    assert u.min() >= 0 and u.max() < 1
    assert np.all(u * 2.0**53 == np.floor(u * 2.0**53))  # 53 random bits, a multiple of 2**-53
    n = len(u)
    ks = max(np.max(np.arange(1, n + 1) / n - u), np.max(u - np.arange(n) / n))
    assert ks < KS_CRITICAL, ks
    bins = 1000
    counts = np.bincount((u * bins).astype(int), minlength=bins)
    chi2 = float(((counts - n / bins) ** 2 / (n / bins)).sum())
    assert chi2 < chi2_critical(bins - 1), chi2
    # the low bits are random too: each of the lowest 8 of the 53 is set half the time
    low = (u * 2.0**53).astype(np.int64)
    for bit in range(8):
        share = float(((low >> bit) & 1).mean())
        assert abs(share - 0.5) < 3.3 * 0.5 / math.sqrt(n), (bit, share)


def test_neighbouring_positions_and_seeds_are_uncorrelated():
    """Pearson correlation of U(s, p) with U(s, p + 1) and with U(s + 1, p): |r| within
    3.3 standard errors (1/sqrt(n)) of 0."""
    along, across = draws_along_positions(), draws_across_seeds()
    bound = 3.3 / math.sqrt(N_DRAWS)
    for u in (along, across):
        assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < bound
    # a pair of (seed, position) grids: seeds 0..n-1 at position 0 and at position 1
    next_position = keyed_uniform(seed_keys(range(N_DRAWS)), torch.ones(N_DRAWS, dtype=torch.long))
    assert abs(np.corrcoef(across, next_position.numpy())[0, 1]) < bound


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_have_the_cpu_bits():
    pairs, cpu_N = grid("cpu")
    _, cuda_N = grid("cuda")
    assert cuda_N.device.type == "cuda"
    assert torch.equal(cuda_N.cpu(), cpu_N)
    big_cpu = keyed_uniform(seed_keys(range(N_DRAWS)), torch.arange(N_DRAWS) * 977)
    big_cuda = keyed_uniform(seed_keys(range(N_DRAWS), "cuda"), torch.arange(N_DRAWS).cuda() * 977)
    assert torch.equal(big_cuda.cpu(), big_cpu)
