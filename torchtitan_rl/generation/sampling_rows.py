"""The sampling settings of the engine's running batch, kept from step to step and
updated by what changed (the sampler's part of a persistent batch).

The sampler takes, for each row of a step's logits, its temperature, top-p, top-k and
random draw U(seed, p) (`keyed_random`: p is the index in its completion of the token the
row samples now), and a `RowPlan` of which rows sample and which filter. Most steps hold
the same requests as the step before, in the same order: then every position moves on by
one (each row recorded a token since; `Engine._record` asserts that each row it records
has as many tokens as its position) and only the draws change. When rows join, leave or
move, the rows kept are gathered from the last step's record (their positions moved on by
one), the joined ones are read from their requests (their position: their token count),
and the plan is rebuilt.

Where they live, allocated once for `max_rows` rows (more on demand):
- on the host, numpy arrays of each row's settings, seed key and position (the settings
  as the request holds them; the plan compares them as the device's float32 fields hold
  them, as `RowPlan.of` does: a temperature that rounds to 0 there is greedy);
- the fields the device reads, in one host buffer (pinned on CUDA) copied to one device
  buffer with a single host-to-device copy per step: its first field (the draws) when the
  rows are the same, all of it when they changed. On CPU the device buffer is the host one.

Device buffer (M = rows allocated; each field starts aligned to its element size):

    uniform f64 [M] | top_k i64 [M] | sampled i64 [M] | filtered i64 [M] |
    temperature f32 [M] | top_p f32 [M]

`sampled` / `filtered` hold the plan's row indices, so a step with greedy rows or a mix of
filtered and unfiltered rows copies no index of its own. The draws are computed on the host
(`keyed_random.host_uniform`: a dozen numpy calls over the rows, where the same hash in
tensor ops is sixteen kernel launches), the same bits as on any device.

Shape legend: N = rows of the step, M = rows allocated.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np
import torch

from torchtitan_rl.generation.keyed_random import host_seed_keys, host_uniform
from torchtitan_rl.generation.sampling import RowPlan
from torchtitan_rl.generation.scheduler import Request

FIELDS = (
    ("uniform", torch.float64),
    ("top_k", torch.int64),
    ("sampled", torch.int64),
    ("filtered", torch.int64),
    ("temperature", torch.float32),
    ("top_p", torch.float32),
)
"""The device buffer's fields, in order (the module docstring's layout)."""
BYTES_PER_ROW = sum(dtype.itemsize for _, dtype in FIELDS)


class SamplingRows:
    """The sampler's inputs for the engine's running batch (see the module docstring).

    Call `update(requests)` before each step's sampling, then read `temperature_N`,
    `top_p_N`, `top_k_N`, `uniform_N`, `plan` and `return_support`. On CUDA `update`
    overwrites the host buffer the last update's copy read from: call it only once the
    device has run that copy (the engine does: it has waited for the last step's results,
    queued after the copy).
    """

    def __init__(self, max_rows: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.requests: list[Request] = []
        """The last step's rows, in its order."""
        self.rebuilds = 0
        """Updates whose rows differed from the update before's."""
        self.plan = RowPlan(sampled_rows=[], filtered_rows=[])
        self.return_support = False
        """Some row wants its sampling support back (the sampler then waits for the device)."""
        self.temperature_N = self.top_p_N = self.top_k_N = self.uniform_N = torch.empty(0)
        """Views of the device buffer, valid until the next `update`."""
        self._allocate(max_rows)

    def _allocate(self, rows: int) -> None:
        M = -(-rows // 4) * 4  # every field then starts 16-byte aligned, as a fresh tensor
        cuda = self.device.type == "cuda"
        self._host_B = torch.zeros(M * BYTES_PER_ROW, dtype=torch.uint8, pin_memory=cuda)
        self._device_B = self._host_B.to(self.device) if cuda else self._host_B
        self._host: dict[str, np.ndarray] = {}
        self._dev: dict[str, torch.Tensor] = {}
        start = 0
        for name, dtype in FIELDS:
            end = start + M * dtype.itemsize
            self._host[name] = self._host_B[start:end].view(dtype).numpy()
            self._dev[name] = self._device_B[start:end].view(dtype)
            start = end
        # The host's record of each row, one array so a step's kept rows move in one call.
        self._rows_6M = np.zeros((6, M), np.int64)
        self._temperature_M = self._rows_6M[0].view(np.float64)
        self._top_p_M = self._rows_6M[1].view(np.float64)
        self._top_k_M = self._rows_6M[2]
        self._support_M = self._rows_6M[3]
        self._key_M = self._rows_6M[4].view(np.uint64)
        self._position_M = self._rows_6M[5]
        self._views_N = -1  # the row count `temperature_N` ... were sliced for
        self.requests = []  # the settings kept are gone: every row of the next step joins

    def update(self, requests: list[Request]) -> None:
        """The settings of the step over `requests`, in the order of its logits' rows."""
        N = len(requests)
        if requests == self.requests:  # the same rows in the same order (Request: by identity)
            self._position_M[:N] += 1  # each recorded a token since
            self._copy(self._draw(N))
            return
        if N > len(self._position_M):
            self._allocate(max(N, 2 * len(self._position_M)))
        self._gather(requests)
        self.requests = list(requests)
        self.rebuilds += 1
        self._stage(N)
        self._copy(self._host_B.numel())

    def positions(self) -> list[int]:
        """Each row's position as `update` set it: the index in its completion of the token
        the row samples now (what its draw is keyed by)."""
        return self._position_M[: len(self.requests)].tolist()

    def sampler_args(self) -> dict:
        """`sample_tokens`' per-row arguments for the step `update` set up."""
        return dict(
            temperature_N=self.temperature_N,
            top_p_N=self.top_p_N,
            top_k_N=self.top_k_N,
            uniform_N=self.uniform_N,
            return_support=self.return_support,
            plan=self.plan,
        )

    def _gather(self, requests: list[Request]) -> None:
        """Rows kept from the last step take their old row's record, their positions moved
        on by one (each recorded a token since); joined rows read theirs from their
        requests."""
        old = dict(zip(self.requests, range(len(self.requests))))  # Request hashes by identity
        src_N = np.fromiter(map(old.get, requests, repeat(-1)), np.int64, len(requests))
        kept_K = np.flatnonzero(src_N >= 0)
        if len(kept_K):  # the right side is a copy: rows may move either way
            self._rows_6M[:, kept_K] = self._rows_6M[:, src_N[kept_K]]
            self._position_M[kept_K] += 1
        joined_J = np.flatnonzero(src_N < 0)
        if len(joined_J):
            joined = [requests[i] for i in joined_J.tolist()]
            params = [r.sampling for r in joined]
            self._temperature_M[joined_J] = [p.temperature for p in params]
            self._top_p_M[joined_J] = [p.top_p for p in params]
            self._top_k_M[joined_J] = [p.top_k for p in params]
            self._support_M[joined_J] = [p.return_support for p in params]
            self._key_M[joined_J] = host_seed_keys([p.seed for p in params])
            self._position_M[joined_J] = [len(r.token_ids) for r in joined]

    def _stage(self, N: int) -> None:
        """Writes the device's fields of the N rows (draws included) to the host buffer and
        rebuilds the plan and the device views."""
        host, dev = self._host, self._dev
        with np.errstate(over="ignore"):  # to fp32 as torch.tensor rounds (1e300 -> inf)
            host["temperature"][:N] = self._temperature_M[:N]
            host["top_p"][:N] = self._top_p_M[:N]
        host["top_k"][:N] = self._top_k_M[:N]
        # the plan reads what the device will hold (a temperature rounded to 0 is greedy)
        temperature_N, top_p_N, top_k_N = (host[f][:N] for f in ("temperature", "top_p", "top_k"))
        sampled_S = np.flatnonzero(temperature_N > 0)
        cut_k_N, cut_p_N = top_k_N > 0, top_p_N < 1
        filtered_F = sampled_S[(cut_k_N | cut_p_N)[sampled_S]]
        S, F = len(sampled_S), len(filtered_F)
        host["sampled"][:S] = sampled_S
        host["filtered"][:F] = filtered_F
        self.plan = RowPlan(
            sampled_rows=sampled_S.tolist(),
            filtered_rows=filtered_F.tolist(),
            top_k=bool(cut_k_N[filtered_F].any()),
            top_p=bool(cut_p_N[filtered_F].any()),
            # the sampler selects rows only when some are left out
            sampled_index=dev["sampled"][:S] if S < N else None,
            filtered_index=dev["filtered"][:F] if F < N else None,
        )
        self.return_support = bool(self._support_M[:N].any())
        if N != self._views_N:
            self.temperature_N = dev["temperature"][:N]
            self.top_p_N = dev["top_p"][:N]
            self.top_k_N = dev["top_k"][:N]
            self.uniform_N = dev["uniform"][:N]
            self._views_N = N
        self._draw(N)

    def _draw(self, N: int) -> int:
        """Each row's U(seed, position) into the host buffer's first field; its bytes."""
        host_uniform(self._key_M[:N], self._position_M[:N], out_N=self._host["uniform"][:N])
        return N * FIELDS[0][1].itemsize

    def _copy(self, nbytes: int) -> None:
        """The host buffer's first `nbytes` to the device, queued (one copy)."""
        if self._device_B is not self._host_B:
            self._device_B[:nbytes].copy_(self._host_B[:nbytes], non_blocking=True)
