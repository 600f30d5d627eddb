"""Stress the trainers' weight gather over gloo: 2 CPU ranks of the tiny FSDP policy train
and publish their weights many times, with other Python threads allocating beside them.

    python scripts/stress_weight_gather.py --gather dtensor --publishes 20000
    python scripts/stress_weight_gather.py --gather rows --publishes 20000

`--gather rows` is what `publish_weights` runs (`packing.gather_into`: one blocking c10d
all-gather per row-sharded tensor); `--gather dtensor` gathers every tensor with DTensor's
own `full_tensor()` (an asynchronous functional collective, then `wait_tensor`), the path
that crashed trainers twice under load (docs/results.md); `--gather none` only trains. A rank that makes no progress for
`--hang-s` seconds dumps every thread's stack (faulthandler) and the run ends with exit
code 1; a rank that dies is reported with its exit code. CPU only; minutes to hours.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 96  # fakes.TRAINER_VOCAB: tiny_core's vocabulary


def _churn(stop: threading.Event) -> None:
    """Allocate and free small tensors, as the actor runtime's threads do beside a step."""
    sizes = torch.randint(1, 5000, (50,)).tolist()
    while not stop.is_set():
        blocks = [torch.empty(n) for n in sizes]
        del blocks


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from fakes import tiny_core

    from torchtitan_rl.weight_sync import packing

    if args.gather == "dtensor":
        packing._row_sharded = lambda t: False  # every tensor through t.full_tensor()
    core = tiny_core(lr=1e-3)  # the tiny policy, vocabulary fakes.TRAINER_VOCAB
    stop = threading.Event()
    churn = [threading.Thread(target=_churn, args=(stop,)) for _ in range(args.churn_threads)]
    for thread in churn:
        thread.start()
    tokens = torch.Generator().manual_seed(rank)
    start = time.time()
    for i in range(args.publishes):
        faulthandler.dump_traceback_later(args.hang_s, exit=True)
        if args.train_every and i % args.train_every == 0:
            _train_step(core, tokens)
        if args.gather == "none":
            pass
        elif rank == 0:
            packing.pack_weights(packing.sharded_state(core.model), i, torch.float32)
        else:
            packing.gather_into(packing.sharded_state(core.model), None)
        if rank == 0 and (i + 1) % 1000 == 0:
            print(f"{args.gather}: {i + 1} publishes, {time.time() - start:.0f} s", flush=True)
    faulthandler.cancel_dump_traceback_later()
    stop.set()
    for thread in churn:
        thread.join()
    print(f"rank {rank}: all {args.publishes} publishes done", flush=True)
    dist.destroy_process_group()


def _train_step(core, tokens: torch.Generator) -> None:
    """One forward, backward and optimizer step on random tokens (FSDP's all-gathers and
    reduce-scatters, and the grad-norm all-reduce, between publishes)."""
    batch, seq = 2, 48
    ids = torch.randint(0, VOCAB, (batch, seq), generator=tokens)
    logprobs, _ = core.model(
        ids,
        torch.arange(seq).repeat(batch, 1),
        torch.zeros(batch, seq, dtype=torch.long),
        torch.arange(batch * seq - 1),
        ids.flatten()[1:],
    )
    (-logprobs.mean()).backward()
    core._optimizer_step(core.optimizer, 0.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gather", choices=["rows", "dtensor", "none"], default="rows")
    p.add_argument("--publishes", type=int, default=20000)
    p.add_argument(
        "--train-every", type=int, default=4, help="a train step every N publishes (0: never)"
    )
    p.add_argument("--churn-threads", type=int, default=2)
    p.add_argument("--hang-s", type=float, default=120.0)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from fakes import free_ports

    ctx = mp.get_context("spawn")
    port = free_ports(1)
    procs = [ctx.Process(target=_worker, args=(r, port, args)) for r in (0, 1)]
    start = time.time()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    codes = [proc.exitcode for proc in procs]
    ok = codes == [0, 0]
    print(
        f"{args.gather}: {'all' if ok else 'NOT all'} {args.publishes} publishes done in "
        f"{time.time() - start:.0f} s; exit codes {codes}"
        + ("" if ok else " (a rank that hung printed its stacks above and exited 1)"),
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
