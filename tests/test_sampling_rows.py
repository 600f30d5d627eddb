"""The engine's persistent sampling rows (generation/sampling_rows.py): over many steps in
which rows join, leave, come back and move, the settings, draws and plan it hands the
sampler, and so the sampled tokens, log-probs and supports, are those built from scratch
from the step's requests; a step whose rows did not change runs no tensor op but the one
copy of its draws."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_rl.generation.keyed_random import keyed_uniform, seed_keys
from torchtitan_rl.generation.sampling import RowPlan, sample_tokens
from torchtitan_rl.generation.sampling_rows import SamplingRows
from torchtitan_rl.generation.scheduler import Request
from torchtitan_rl.types import SamplingParams

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.0),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.95, top_k=20),
    dict(temperature=0.0, top_p=0.5),  # greedy: its filter is ignored
    dict(temperature=1.0, return_support=True),
]
SEEDS = [0, 1, -5, 2**63 + 1, 2**70 + 3, 12345]


def pool(n: int, settings: list[dict]) -> list[Request]:
    loop = asyncio.new_event_loop()
    requests = []
    for i in range(n):
        sampling = SamplingParams(seed=SEEDS[i % len(SEEDS)] + 7 * i, **settings[i % len(settings)])
        requests.append(Request(str(i), [1, 2], sampling, loop.create_future(), 0.0))
    loop.close()
    return requests


def from_scratch(requests: list[Request], device: str) -> dict:
    """The sampler's inputs built from the requests alone (what the engine built at every
    step whose rows changed, before the rows were kept)."""
    params = [r.sampling for r in requests]
    temps, top_ps, top_ks = (
        [p.temperature for p in params],
        [p.top_p for p in params],
        [p.top_k for p in params],
    )
    return dict(
        temperature_N=torch.tensor(temps, device=device),
        top_p_N=torch.tensor(top_ps, device=device),
        top_k_N=torch.tensor(top_ks, device=device),
        key_N=seed_keys([p.seed for p in params], device),
        position_N=torch.tensor([len(r.token_ids) for r in requests], device=device),
        plan=RowPlan.of(temps, top_ps, top_ks),
        return_support=any(p.return_support for p in params),
    )


def next_rows(rng: random.Random, rows: list[Request], everyone: list[Request], most: int):
    """The last step's rows (half the time), or some of them in another order with others
    joined: new requests and ones that ran before."""
    if rows and rng.random() < 0.5:
        return rows
    kept = rng.sample(rows, rng.randint(0, len(rows)))
    others = [r for r in everyone if r not in kept]
    joined = rng.sample(others, rng.randint(0 if kept else 1, min(len(others), most - len(kept))))
    at = rng.randint(0, len(kept))
    out = kept[:at] + joined + kept[at:]
    return out if rng.random() < 0.5 else out[::-1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("settings", ["mixed", "top_p", "temperature"])
def test_rows_joining_leaving_and_moving_sample_as_rows_built_from_scratch(device, settings):
    """200 steps over 24 requests, up to 12 rows a step (more than the 8 first allocated):
    every step's tensors, draws, plan and samples equal the from-scratch build's."""
    chosen = {"mixed": SETTINGS, "top_p": SETTINGS[2:3], "temperature": SETTINGS[:1]}[settings]
    everyone = pool(24, chosen)
    rows = SamplingRows(max_rows=8, device=device)
    rng = random.Random(settings)
    logits_NV = torch.randn(12, 50, generator=torch.Generator().manual_seed(0)).to(device) * 3
    step_rows: list[Request] = []
    kept_steps = 0
    for _ in range(200):
        new_rows = next_rows(rng, step_rows, everyone, most=12)
        kept_steps += new_rows == step_rows  # Request compares by identity
        step_rows = list(new_rows)
        rows.update(step_rows)
        want = from_scratch(step_rows, device)
        assert torch.equal(rows.temperature_N, want["temperature_N"])
        assert torch.equal(rows.top_p_N, want["top_p_N"])
        assert torch.equal(rows.top_k_N, want["top_k_N"])
        assert torch.equal(rows.uniform_N, keyed_uniform(want["key_N"], want["position_N"]))
        plan, want_plan = rows.plan, want["plan"]
        assert (plan.sampled_rows, plan.filtered_rows, plan.top_k, plan.top_p) == (
            want_plan.sampled_rows,
            want_plan.filtered_rows,
            want_plan.top_k,
            want_plan.top_p,
        )
        N = len(step_rows)
        for index, chosen in (
            (plan.sampled_index, plan.sampled_rows),
            (plan.filtered_index, plan.filtered_rows),
        ):  # on the device when the sampler selects them: some rows left out
            assert index is None if len(chosen) == N else index.tolist() == chosen
        assert rows.return_support == want["return_support"]
        got = sample_tokens(logits_NV[:N], **rows.sampler_args())
        ref = sample_tokens(logits_NV[:N], **want)
        assert torch.equal(got.token_ids_N, ref.token_ids_N)
        assert torch.equal(got.logprobs_N, ref.logprobs_N)
        if ref.support is not None:
            assert all(torch.equal(a, b) for a, b in zip(got.support, ref.support))
        for request, token in zip(step_rows, got.token_ids_N.tolist()):
            request.token_ids.append(token)  # as the engine records each row's token
    assert 50 < kept_steps < 150 and rows.rebuilds == 200 - kept_steps


class _Ops(TorchDispatchMode):
    """Counts the tensor ops run under it, views left out (they launch nothing)."""

    VIEWS = {"aten.slice.Tensor", "aten.view.dtype", "aten.alias.default"}

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in self.VIEWS:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_updates_its_rows_with_at_most_one_copy_and_no_other_tensor_op(device):
    """Same rows: the draws alone are copied; rows changed: one copy of every field (on CPU
    the device reads the host buffer: no op at all)."""
    everyone = pool(64, SETTINGS)
    rows = SamplingRows(max_rows=64, device=device)
    copies = {"aten.copy_.default": 1} if device == "cuda" else {}
    for step_rows in (everyone[:40], everyone[:40], everyone[20:][::-1], everyone[20:][::-1]):
        with _Ops() as counted:
            rows.update(step_rows)
        assert dict(counted.ops) == copies
        for request in step_rows:
            request.token_ids.append(0)
    assert rows.rebuilds == 2
