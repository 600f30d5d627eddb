"""Counter-based random draws: the uniform behind a request's token at position p is a
pure function U(seed, p): with tensor ops on any device (`keyed_uniform`), or with numpy on
the host (`host_uniform`, what the engine uses: a dozen vectorised calls per step, where
the tensor ops would be sixteen kernel launches), the same bits either way.

p is the token's index in its completion (0 for the first sampled token). No generator
state exists, so a request's draws do not depend on which rows share its steps, on its row
in them, on preemption, recompute or a look-ahead row dropped: its token at position p
always uses U(seed, p), on any device.

U(seed, p) is output p of SplitMix64 (Steele, Lea, Flood, "Fast splittable pseudorandom
number generators", OOPSLA 2014) started from a hash of the seed:

    key     = fmix64(seed) + GAMMA                       once per request (`seed_keys`)
    U(s, p) = (mix64(key + p * GAMMA) >>> 11) * 2**-53   every step (`keyed_uniform`)

fmix64 (MurmurHash3's finaliser) sends nearby seeds (0, 1, 2, ...) to unrelated points of
the Weyl sequence `key + p * GAMMA`; mix64 is SplitMix64's finaliser. The tensor arithmetic
is on int64, whose multiplication and addition wrap in two's complement on CPU and CUDA
alike; torch's `>>` on int64 is arithmetic, so a logical shift by k is the arithmetic one
with the k sign-extended top bits masked off. numpy's is on uint64 (wrapping, logical
shifts). Same bits on every device and on the host (`tests/test_keyed_random.py` checks
them against Python integers). The result is a float64
in [0, 1 - 2**-53], a multiple of 2**-53 (53 random bits; never 1), as the sampler's
float64 inverse CDF takes it.

Shape legend: N = rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from torchtitan_rl.device import to_device_async

MASK64 = (1 << 64) - 1


def as_int64(value: int) -> int:
    """The 64-bit two's-complement pattern of `value` (any Python int) as an int64 holds it."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


GAMMA = as_int64(0x9E3779B97F4A7C15)
"""SplitMix64's Weyl increment (odd: the sequence visits every 64-bit value)."""
_FMIX = (33, as_int64(0xFF51AFD7ED558CCD), 33, as_int64(0xC4CEB9FE1A85EC53), 33)
_MIX = (30, as_int64(0xBF58476D1CE4E5B9), 27, as_int64(0x94D049BB133111EB), 31)
_LOW53 = (1 << 53) - 1


def _xor_shift_(x_N: torch.Tensor, k: int) -> None:
    """x ^= x >>> k (logical shift), in place."""
    x_N.bitwise_xor_(x_N.bitwise_right_shift(k).bitwise_and_((1 << (64 - k)) - 1))


def _mix_(x_N: torch.Tensor, constants: tuple[int, int, int, int, int]) -> torch.Tensor:
    """xor-shift, multiply, xor-shift, multiply, xor-shift, in place (wrapping int64)."""
    s1, m1, s2, m2, s3 = constants
    _xor_shift_(x_N, s1)
    x_N.mul_(m1)
    _xor_shift_(x_N, s2)
    x_N.mul_(m2)
    _xor_shift_(x_N, s3)
    return x_N


_U64_GAMMA = np.uint64(GAMMA & MASK64)
_U64_FMIX, _U64_MIX = (tuple(np.uint64(c & MASK64) for c in cs) for cs in (_FMIX, _MIX))


def _host_mix_(x_N: np.ndarray, constants: tuple[np.uint64, ...]) -> np.ndarray:
    """`_mix_` on a uint64 array, in place (numpy wraps and shifts logically)."""
    s1, m1, s2, m2, s3 = constants
    x_N ^= x_N >> s1
    x_N *= m1
    x_N ^= x_N >> s2
    x_N *= m2
    x_N ^= x_N >> s3
    return x_N


def host_seed_keys(seeds: Sequence[int]) -> np.ndarray:
    """Each seed's key (uint64 bits of `seed_keys`'s int64), on the host. Seeds (Python or
    numpy integers) are taken modulo 2**64."""
    try:  # the usual seeds fit an int64 as they are (two's complement for negatives)
        seed_N = np.array(seeds, dtype=np.int64)
    except (OverflowError, ValueError):  # a seed outside the int64 range
        seed_N = np.array([as_int64(int(s)) for s in seeds], dtype=np.int64)
    key_N = _host_mix_(seed_N.view(np.uint64), _U64_FMIX)
    key_N += _U64_GAMMA
    return key_N


def seed_keys(seeds: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Each seed's key (int64, on `device`): computed on the host, copied without waiting
    for the device. Seeds (Python or numpy integers) are taken modulo 2**64."""
    key_N = torch.from_numpy(host_seed_keys(seeds).view(np.int64))
    return to_device_async(key_N, torch.device(device))


def host_uniform(
    key_N: np.ndarray, position_N: np.ndarray, out_N: np.ndarray | None = None
) -> np.ndarray:
    """U(seed, p) per row, as `keyed_uniform` computes it, with numpy: from uint64 keys
    (`host_seed_keys`) and int64 positions, into float64 `out_N` (a new array if None)."""
    x_N = position_N.astype(np.uint64)
    x_N *= _U64_GAMMA
    x_N += key_N  # key + p * GAMMA, wrapping
    _host_mix_(x_N, _U64_MIX)
    x_N >>= np.uint64(11)
    return np.multiply(x_N, 2.0**-53, out=out_N)


def keyed_uniform(key_N: torch.Tensor, position_N: torch.Tensor) -> torch.Tensor:
    """U(seed, p) per row: float64 in [0, 1), from int64 keys (`seed_keys`) and positions,
    on their device, without a host sync."""
    x_N = torch.add(key_N, position_N, alpha=GAMMA)  # key + p * GAMMA, wrapping
    _mix_(x_N, _MIX)
    return x_N.bitwise_right_shift_(11).bitwise_and_(_LOW53).to(torch.float64).mul_(2.0**-53)
