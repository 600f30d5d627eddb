"""Benchmark: log-prob (and entropy) of sampled tokens from hidden states, forward + backward.

    python scripts/bench_logprob.py              # H200: T=32768, D=1024, V=151936, bf16
    python scripts/bench_logprob.py --tune       # also times kernel tile shapes first
    python scripts/bench_logprob.py --smoke      # tiny CPU case, a few seconds

Every row computes per-token outputs for T tokens and backpropagates
loss = sum(a * logprob [+ b * entropy]) with random a, b into hidden [T, D] and weight
[V, D]. Time: median of --repeats after --warmup runs. Extra peak: peak allocated memory
during one forward + backward minus what was allocated before it (inputs), so it includes
the two input gradients (0.35 GiB at the default shape). Floors: 6 T D V FLOPs (one
forward and two backward products, logits kept) and 8 T D V (logits recomputed in the
backward, as every row here but the naive one does) at the measured bf16 matmul rate.
Writes JSON to --out (default $OUT/bench_logprob.json, else outputs/bench_logprob.json).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from torchtitan_rl.losses.logprobs import token_logprobs

GIB = 2**30


def naive(h, w, t):
    logp = torch.log_softmax((h @ w.T).float(), dim=-1)
    return logp.gather(1, t[:, None]).squeeze(1), None


def naive_with_entropy(h, w, t):
    logp = torch.log_softmax((h @ w.T).float(), dim=-1)
    return logp.gather(1, t[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def liger(h, w, t):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return -liger_fused_linear_cross_entropy(h, w, t, reduction="none"), None


def cce(h, w, t):
    from cut_cross_entropy import linear_cross_entropy

    return -linear_cross_entropy(h, w, t, reduction="none"), None


def ours_without_entropy(h, w, t):
    return token_logprobs(h, w, t, with_entropy=False)


@contextlib.contextmanager
def kernel_settings(**overrides):
    """Temporarily set module constants of logprobs_triton (forward and backward see them)."""
    if not overrides:
        yield
        return
    from torchtitan_rl.losses import logprobs_triton

    saved = {k: getattr(logprobs_triton, k) for k in overrides}
    for k, v in overrides.items():
        setattr(logprobs_triton, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(logprobs_triton, k, v)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(step: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, device, warmup=3, repeats=10)
    return 2 * size**3 / (ms * 1e-3) / 1e12


def run_impl(fn, inputs, device, warmup, repeats, backward=True):
    """(median ms, extra peak GiB or None) of forward (+ backward) of one implementation."""
    h, w, t, a, b = inputs

    def step():
        h.grad = w.grad = None
        with torch.set_grad_enabled(backward):
            lp, ent = fn(h, w, t)
            if backward:
                loss = (a * lp).sum() + ((b * ent).sum() if ent is not None else 0.0)
                loss.backward()

    ms = time_ms(step, device, warmup, repeats)
    extra = None
    if device.type == "cuda":
        h.grad = w.grad = None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        sync(device)
        extra = (torch.cuda.max_memory_allocated() - base) / GIB
    h.grad = w.grad = None
    return ms, extra


def make_inputs(tokens, dim, vocab, dtype, device):
    gen = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(tokens, dim, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, dim, generator=gen) / dim**0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    a = torch.randn(tokens, generator=gen).to(device)
    b = torch.randn(tokens, generator=gen).to(device)
    return h, w, t, a, b


def tune(inputs, device, warmup, repeats) -> list[dict]:
    """Times forward tile shapes (forward only), then backward ones (forward + backward)."""
    from torchtitan_rl.losses import logprobs_triton as lt

    TC = lt.TileConfig
    forward = [
        TC(), TC(maxnreg=128), TC(block_n=256), TC(block_v=256), TC(num_stages=4),
        TC(num_stages=4, tma=False),
    ]  # fmt: skip
    backward = [
        TC(block_v=256), TC(maxnreg=128), TC(num_stages=4), TC(block_n=256),
        TC(block_v=256, tma=False),
    ]  # fmt: skip
    rows = []
    fn = token_logprobs
    for kernel, configs in (("forward", forward), ("forward+backward", backward)):
        timed = []
        for cfg in configs:
            setattr(lt, "FORWARD_TILES" if kernel == "forward" else "BACKWARD_TILES", cfg)
            try:
                ms, _ = run_impl(fn, inputs, device, warmup, repeats, backward=kernel != "forward")
            except RuntimeError as e:  # e.g. out of shared memory: record, try the next
                print(f"  tune {kernel} {cfg}: failed ({str(e)[:100]})")
                continue
            timed.append((ms, cfg))
            rows.append({"kernel": kernel, "config": repr(cfg), "ms": ms})
            print(f"  tune {kernel:<17} {ms:8.2f} ms  {cfg!r}")
        best = min(timed, key=lambda t: t[0])[1]
        setattr(lt, "FORWARD_TILES" if kernel == "forward" else "BACKWARD_TILES", best)
    print(f"  chosen: forward {lt.FORWARD_TILES!r}, backward {lt.BACKWARD_TILES!r}")
    return rows


def loss_fused_parts(inputs, device, warmup, repeats, chunk: int = 2048) -> float:
    """ms of the work a head fused with its loss must do at least, if it keeps each chunk's
    logits instead of recomputing them (6 T D V FLOPs; needs the per-token loss gradient
    during the forward, so token-level losses only). Per chunk of `chunk` tokens: cuBLAS
    z = h W^T (bf16, cheaper than the fp32 an exact softmax wants), one in-place pass over
    z (a softmax gradient needs at least this one), grad_h = z W and grad_W += z^T h. No
    softmax reductions: not a working head, a lower bound on that design."""
    h, w, _, _, _ = inputs
    hd, wd = h.detach(), w.detach()
    z = torch.empty(chunk, wd.shape[0], dtype=wd.dtype, device=device)
    grad_h, grad_w = torch.empty_like(hd), torch.zeros_like(wd)

    def step():
        grad_w.zero_()
        for t0 in range(0, hd.shape[0], chunk):
            h_c = hd[t0 : t0 + chunk]
            z_c = z[: h_c.shape[0]]
            torch.mm(h_c, wd.T, out=z_c)
            z_c.mul_(0.5)
            torch.mm(z_c, wd, out=grad_h[t0 : t0 + chunk])
            grad_w.addmm_(z_c.T, h_c)

    return time_ms(step, device, warmup, repeats)


def check_against_naive(inputs, rows: int = 4096) -> dict[str, float]:
    """Relative error of ours vs the naive fp32-softmax head on the first rows (sanity)."""
    h, w, t, a, b = inputs
    hs, ws = h[:rows].detach().requires_grad_(), w.detach().requires_grad_()
    outs = []
    for fn in (token_logprobs, naive_with_entropy):
        lp, ent = fn(hs, ws, t[:rows])
        grads = torch.autograd.grad((a[:rows] * lp).sum() + (b[:rows] * ent).sum(), (hs, ws))
        outs.append([lp.detach().double(), ent.detach().double(), *(g.double() for g in grads)])
    names = ("logprob", "entropy", "grad_hidden", "grad_weight")
    errors = {n: ((x - y).norm() / y.norm()).item() for n, x, y in zip(names, *outs)}
    print("  ours vs naive (relative error norms): "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))  # fmt: skip
    return errors


def profile(fn, inputs, rows: int = 12) -> list[dict]:
    """GPU time per kernel name over one forward + backward (profiler, after warm-up)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    h, w, t, a, b = inputs

    def step():
        h.grad = w.grad = None
        lp, ent = fn(h, w, t)
        ((a * lp).sum() + ((b * ent).sum() if ent is not None else 0.0)).backward()

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        us = e.device_time_total
        entry = totals.setdefault(e.name[:90], [0.0, 0])
        entry[0] += us / 1e3
        entry[1] += 1
    table = sorted(({"kernel": k, "ms": v[0], "calls": v[1]} for k, v in totals.items()),
                   key=lambda r: -r["ms"])[:rows]  # fmt: skip
    print(
        f"  profile (GPU ms per kernel over one fwd+bwd, total {sum(v[0] for v in totals.values()):.1f}):"
    )
    for r in table:
        print(f"    {r['ms']:7.2f} ms  x{r['calls']:<4} {r['kernel']}")
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny CPU case")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tune", action="store_true", help="time tile shapes and use the best")
    p.add_argument("--profile", action="store_true", help="per-kernel GPU time of ours")
    p.add_argument("--skip", default="", help="row names to leave out, separated by ';'")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.smoke:
        device, args.tokens, args.dim, args.vocab = torch.device("cpu"), 256, 64, 1024
        args.repeats, args.warmup, args.tune = 3, 1, False
    else:
        device = torch.device("cuda")
    dtype = torch.bfloat16
    T, D, V = args.tokens, args.dim, args.vocab
    rate = matmul_tflops(device, dtype, 256 if args.smoke else 8192)
    print(f"device: {_device_name(device)}; bf16 matmul {rate:.3g} TFLOP/s; T={T} D={D} V={V}")
    if device.type == "cuda":
        print(f"cuBLAS bf16 x bf16 -> fp32 accumulate (addmm out_dtype): {_addmm_fp32_ok(device)}")
    inputs = make_inputs(T, D, V, dtype, device)
    tuning = tune(inputs, device, 1, 3) if args.tune else []
    errors = check_against_naive(inputs, rows=min(T, 4096))
    profiles = {}
    if args.profile and device.type == "cuda":
        try:
            profiles["ours"] = profile(token_logprobs, inputs)
        except (AttributeError, AssertionError, RuntimeError) as e:  # diagnostics only
            print(f"    profile failed: {type(e).__name__}: {e}")

    cuda = device.type == "cuda"
    # (name, function, entropy, notes, optional package it needs, runs on this device)
    impls: list[tuple[str, Callable, bool, str, str | None, bool]] = [
        ("ours (with entropy)", token_logprobs, True, "exact", None, True),
        ("ours, no entropy", ours_without_entropy, False, "exact", None, cuda),
        ("ours, 512 MiB dlogits buffer", token_logprobs, True, "exact", None, cuda),
        ("liger-kernel FLCE, reduction=none", liger, False, "exact", "liger_kernel", cuda),
        ("cut-cross-entropy, reduction=none", cce, False, "filters small grads",
         "cut_cross_entropy", cuda),
        ("naive: h@W.T, fp32 log_softmax", naive, False, "full [T,V] fp32 logits", None, True),
        ("naive with entropy", naive_with_entropy, True, "full [T,V] fp32 logits", None, True),
    ]  # fmt: skip
    skip = {s.strip() for s in args.skip.split(";") if s.strip()}
    rows = []
    for name, fn, entropy, note, package, runs_here in impls:
        if name in skip:
            continue
        if package is not None and importlib.util.find_spec(package) is None:
            print(f"  {name}: skipped ({package} is not installed)")
            continue
        if not runs_here:
            continue
        settings = {"DLOGITS_BUFFER_BYTES": 512 * 2**20} if "512 MiB" in name else {}
        try:
            with kernel_settings(**settings):
                ms, extra = run_impl(fn, inputs, device, args.warmup, args.repeats)
        except (ImportError, RuntimeError) as e:  # a broken wheel or an OOM: say so, go on
            if not cuda:  # on CPU neither is expected: a smoke must fail loudly
                raise
            print(f"  {name}: skipped ({type(e).__name__}: {str(e)[:120]})")
            torch.cuda.empty_cache()
            continue
        rows.append(dict(name=name, ms=ms, extra_peak_gib=extra, entropy=entropy, notes=note))
        print(f"  {name}: {ms:.2f} ms, extra {_gib(extra)}")
    if device.type == "cuda" and "loss-fused parts" not in skip:
        ms = loss_fused_parts(inputs, device, args.warmup, args.repeats)
        rows.append(
            dict(name="loss-fused parts", ms=ms, extra_peak_gib=None, entropy=None,
                 notes="bf16 logits of 2048-token chunks kept: 3 cuBLAS products + 1 in-place "
                 "pass; no softmax, a lower bound, not a head")
        )  # fmt: skip
        print(f"  loss-fused parts: {ms:.2f} ms")
    for factor in (6, 8):
        floor_ms = factor * T * D * V / (rate * 1e12) * 1e3
        what = "logits kept" if factor == 6 else "logits recomputed in backward"
        rows.append(
            dict(name=f"floor {factor}*T*D*V", ms=floor_ms, extra_peak_gib=None, entropy=None,
                 notes=f"at {rate:.3g} TFLOP/s; {what}")
        )  # fmt: skip
    _print_table(rows)
    result = dict(
        device=_device_name(device), torch=torch.__version__, triton=_triton_version(),
        shape=dict(tokens=T, dim=D, vocab=V, dtype="bfloat16"), repeats=args.repeats,
        matmul_tflops=rate, rows=rows, tuning=tuning, profiles=profiles, vs_naive=errors,
    )  # fmt: skip
    out = Path(args.out or Path(os.environ.get("OUT", "outputs")) / "bench_logprob.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def _addmm_fp32_ok(device) -> bool:
    acc = torch.zeros(4, 4, device=device)
    a = torch.ones(4, 8, device=device, dtype=torch.bfloat16)
    try:
        torch.addmm(acc, a, a.T, out_dtype=torch.float32, out=acc)
    except RuntimeError:
        return False
    return bool((acc == 8).all())


def _gib(x):
    return "n/a" if x is None else f"{x:.2f} GiB"


def _print_table(rows):
    print("\n| implementation | ms | extra peak GiB | entropy | notes |\n|---|---|---|---|---|")
    for r in rows:
        extra = "" if r["extra_peak_gib"] is None else f"{r['extra_peak_gib']:.2f}"
        ent = {True: "yes", False: "no", None: ""}[r["entropy"]]
        print(f"| {r['name']} | {r['ms']:.1f} | {extra} | {ent} | {r['notes']} |")


def _device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def _triton_version():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()
