"""vocab_parallel_token_logprobs on 2 gloo ranks against a float64 full-vocabulary reference.

Reference (independent of both implementations): z = h W^T / temperature over the whole
vocabulary, logprob = log_softmax(z)[target], entropy = -sum softmax(z) * log_softmax(z);
gradients of loss = sum(a * logprob + b * entropy) with random a, b. Each rank holds rows
[start, start + ceil(V / 2)) of W (torch.chunk / DTensor Shard(0) layout), must return the
full-vocabulary values, the full hidden-state gradient and its own rows of the weight
gradient. The single-rank dense `token_logprobs` is checked against the same reference.
"""

from __future__ import annotations

import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchtitan_rl.losses.logprobs import token_logprobs, vocab_parallel_token_logprobs

WORLD = 2
CASES = [
    # n, d, v, chunk_size, temperature, with_entropy, dtype
    (37, 16, 101, 8, 0.7, True, torch.float64),  # odd V: shards of 51 and 50 rows
    (64, 8, 54, 64, 1.0, True, torch.float64),
    (5, 12, 7, 1024, 1.3, False, torch.float64),  # log-probs only
    (1, 4, 3, 3, 0.7, True, torch.float64),  # one row; shards of 2 and 1
    (33, 16, 80, 16, 1.0, True, torch.float32),
]


def reference(hidden_ND, weight_VD, targets_N, temperature):
    logp_NV = torch.log_softmax(hidden_ND @ weight_VD.T / temperature, dim=-1)
    logprobs_N = logp_NV.gather(1, targets_N[:, None]).squeeze(1)
    return logprobs_N, -(logp_NV.exp() * logp_NV).sum(-1)


def _inputs(n, d, v, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden_ND = torch.randn(n, d, generator=gen, dtype=torch.float64)
    weight_VD = torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5 * 3
    targets_N = torch.randint(0, v, (n,), generator=gen)
    coef_a_N = torch.randn(n, generator=gen, dtype=torch.float64)
    coef_b_N = torch.randn(n, generator=gen, dtype=torch.float64)
    return hidden_ND, weight_VD, targets_N, coef_a_N, coef_b_N


def _grads(fn, hidden_ND, weight_VD, coef_a_N, coef_b_N):
    hidden_ND = hidden_ND.detach().requires_grad_()
    weight_VD = weight_VD.detach().requires_grad_()
    logprobs_N, entropy_N = fn(hidden_ND, weight_VD)
    loss = (coef_a_N * logprobs_N.double()).sum()
    if entropy_N is not None:
        loss = loss + (coef_b_N * entropy_N.double()).sum()
    grad_h, grad_w = torch.autograd.grad(loss, (hidden_ND, weight_VD))
    return logprobs_N, entropy_N, grad_h, grad_w


def _max_err(got, want) -> float:
    return float((got.detach().double() - want.detach().double()).abs().max())


def _check_case(rank, n, d, v, chunk, temperature, with_entropy, dtype, seed) -> list[str]:
    hidden_ND, weight_VD, targets_N, a_N, b_N = _inputs(n, d, v, seed)

    def ref(h, w):
        logprobs_N, entropy_N = reference(h, w, targets_N, temperature)
        return logprobs_N, entropy_N if with_entropy else None

    want = _grads(ref, hidden_ND, weight_VD, a_N, b_N)
    rows = -(-v // WORLD)
    start = rank * rows
    shard_VD = weight_VD[start : start + rows]

    def parallel(h, w):
        return vocab_parallel_token_logprobs(
            h, w, targets_N, vocab_start=start, temperature=temperature,
            chunk_size=chunk, with_entropy=with_entropy,
        )  # fmt: skip

    def dense(h, w):
        return token_logprobs(
            h, w, targets_N, temperature=temperature, chunk_size=chunk, with_entropy=with_entropy
        )

    tol = 1e-10 if dtype == torch.float64 else 2e-5
    errors = []
    for name, fn, w in (("parallel", parallel, shard_VD), ("dense", dense, weight_VD)):
        got = _grads(fn, hidden_ND.to(dtype), w.to(dtype), a_N, b_N)
        pairs = {
            "logprobs": (got[0], want[0]),
            "grad_hidden": (got[2], want[2]),
            "grad_weight": (got[3], want[3][start : start + rows] if name == "parallel" else want[3]),
        }  # fmt: skip
        if with_entropy:
            pairs["entropy"] = (got[1], want[1])
        elif got[1] is not None:
            errors.append(f"{name}: entropy returned although with_entropy=False")
        for key, (g, r) in pairs.items():
            scale = max(1.0, float(r.detach().abs().max()))
            if g.shape != r.shape or _max_err(g, r) > tol * scale:
                errors.append(f"rank {rank} {name} {key} n={n} v={v}: {_max_err(g, r):.3e}")
    return errors


def _worker(rank: int, port: int, queue) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
        )
        errors = []
        for seed, case in enumerate(CASES):
            errors += _check_case(rank, *case, seed=seed)
        queue.put((rank, errors))
    except Exception:
        queue.put((rank, [traceback.format_exc()]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vocab_parallel_matches_full_vocab_reference_on_two_gloo_ranks():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert sorted(results) == list(range(WORLD))
    errors = [e for r in sorted(results) for e in results[r]]
    assert not errors, "\n".join(errors)
