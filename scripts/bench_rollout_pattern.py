"""The RL loop's generation request pattern without the trainer: the real generator actor(s)
over Monarch and the real Rollouter, each backend side by side (one process tree at a time).

    python scripts/bench_rollout_pattern.py --backends native vllm --rollouts 64 256 \\
        --batches 8 --skip 3 --label "$(git rev-parse --short HEAD)"

The job file (`--config`, default the 0.6B job: AlphabetSort, 3 turns, groups of 8) and
`--set section.key=value` overrides say what the controller would build: the generator actors
are spawned by `launcher.spawn_generators` on the GPU the placement gives them, and each batch is
`Rollouter.collect_batch` over `ActorGenerateFn`s (a `Router` with several replicas), with
`rollouts / rollout.group_size` prompts per batch. Weights are a random init (no trainer, no
warm start): the native engine its own, vLLM a Hugging Face folder exported from a random init
with job.seed (as the controller exports the trainer's initial policy), or model.hf_checkpoint.
Every group is kept (rollout.filter_zero_std_groups = false), so a batch is exactly `rollouts`
rollouts. The first `--skip` batches (compile, graph capture, warm-up) are left out of the
means. Columns: see docs/benchmarks.md ("In-loop request pattern").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from torchtitan_rl.train import leave
from torchtitan_rl.types import FinishReason

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "train_configs/alphabet_sort_qwen3_0.6b.toml"
SMOKE_CONFIG = "train_configs/alphabet_sort_tiny.toml"
SMOKE_SET = ["parallelism.device=cpu", "parallelism.cpu_threads_per_proc=1", "env.max_turns=3",
             "rollout.max_tokens=8", "generator.max_num_seqs=16"]  # fmt: skip
"""The tiny job on CPU with 3 short turns, one thread per process (more threads than cores
make torch processes wait for each other: docs/benchmarks.md, "Cores, processes")."""
COLUMNS = {
    "backend": "{}", "rollouts": "{}", "s_per_batch": "{:.3f}", "min_s": "{:.3f}",
    "vs_vllm": "{:.2f}x", "tokens_per_s": "{:,.0f}", "engine_steps": "{:.0f}",
    "floor_steps": "{:.0f}", "ttft_p50_ms": "{:.1f}", "ttft_p99_ms": "{:.1f}",
    "queue_p50_ms": "{:.1f}", "queue_p99_ms": "{:.1f}", "overhead_p50_ms": "{:.1f}",
    "overhead_p99_ms": "{:.1f}", "gpu_busy": "{:.0%}",
}  # fmt: skip
"""The table's columns and their formats (a missing value prints n/a)."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="job file")
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="job overrides, e.g. --set generator.max_num_seqs=128")  # fmt: skip
    p.add_argument("--backends", nargs="+", default=["native", "vllm"])
    p.add_argument("--rollouts", type=int, nargs="+", default=[64, 256], help="per batch")
    p.add_argument("--batches", type=int, default=8, help="batches per rollout count")
    p.add_argument("--skip", type=int, default=3, help="first batches left out of the means")
    p.add_argument("--cut-ends-rollout", action="store_true",
                   help="the loop's rule: a turn cut at max_tokens ends its rollout (random "
                   "weights: one turn each); default: it goes on to every env turn")  # fmt: skip
    p.add_argument("--label", default="", help="a name for this run, kept in the JSON")
    p.add_argument("--out", default="", help="folder of the JSON ($OUT, else .)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU job, native, 8 x 2 batches")
    args = p.parse_args()
    if args.smoke:
        args.config, args.set = SMOKE_CONFIG, [*SMOKE_SET, *args.set]
        args.backends, args.rollouts, args.batches, args.skip = ["native"], [8], 2, 1
    if not 0 <= args.skip < args.batches:
        fail(f"--skip={args.skip} must be >= 0 and below --batches={args.batches}")
    return args


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class TimedGenerateFn:
    """A GenerateFn around one replica's: each turn's client round trip (sending the turn to
    its completion arriving back), in ms by request id. `continue_cut`: a turn cut at
    max_tokens reaches the environment as if it had stopped there, so the rollout goes on
    (random weights never sample the end-of-turn token, and the loop ends a rollout at a
    cut turn: without this every rollout would be one turn long)."""

    def __init__(self, inner, continue_cut: bool):
        self.inner = inner
        self.continue_cut = continue_cut
        self.round_trip_ms: dict[str, float] = {}

    async def __call__(self, prompt_ids, *, request_id, session_id=None, sampling=None):
        t0 = time.perf_counter()
        completion = await self.inner(
            prompt_ids, request_id=request_id, session_id=session_id, sampling=sampling
        )
        self.round_trip_ms[request_id] = 1e3 * (time.perf_counter() - t0)
        if self.continue_cut and completion and completion.finish_reason == FinishReason.LENGTH:
            completion = dataclasses.replace(completion, finish_reason=FinishReason.STOP)
        return completion


class GpuBusy:
    """`nvidia-smi` sampling one GPU's utilization (the first replica's) every 100 ms in the
    background; `stop` returns the mean busy fraction (None without a GPU)."""

    def __init__(self, gpu: int | None):
        self.proc = None
        if gpu is not None and shutil.which("nvidia-smi"):
            cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                   "-lms", "100", "-i", str(gpu)]  # fmt: skip
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    def stop(self) -> float | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        samples = [float(line) for line in out.split() if line.strip().isdigit()]
        return float(np.mean(samples)) / 100 if samples else None


async def engine_steps(generators) -> int | None:
    """The most engine steps any replica has taken since it started (`engine_stats`; None
    when the package or the engine does not count them)."""
    from torchtitan_rl.actors.generator import GeneratorActor

    if not hasattr(GeneratorActor, "engine_stats"):  # an older package (a baseline run)
        return None
    stats = await asyncio.gather(*(g.engine_stats.call_one() for g in generators))
    steps = [s.get("steps") for s in stats]
    return None if None in steps else max(steps)


async def run_batch(rollouter, generate_fn, timers, generators, step: int, first: int) -> dict:
    """One batch of the loop (`collect_batch`), and what its turns and the engine report."""
    for timer in timers:
        timer.round_trip_ms.clear()
    steps0 = await engine_steps(generators)
    t0 = time.perf_counter()
    batch = await rollouter.collect_batch(step, first, generate_fn)
    seconds = time.perf_counter() - t0
    steps1 = await engine_steps(generators)
    round_trip = {k: v for t in timers for k, v in t.round_trip_ms.items()}
    rollouts = [r for g in batch.sampled() for r in g.rollouts]
    turns = [t.completion for r in rollouts for t in r.turns]
    metric = {k: [c.metrics.get(f"generator/{k}", np.nan) for c in turns]
              for k in ("time_to_first_token_ms", "queue_time_ms", "decode_time_ms")}  # fmt: skip
    engine_ms = np.add(metric["time_to_first_token_ms"], metric["decode_time_ms"])
    return {
        "seconds": seconds,
        "tokens": sum(c.num_tokens for c in turns),
        "turns_per_rollout": len(turns) / len(rollouts),
        "errors": sum(r.status.is_error() for r in rollouts),
        "engine_steps": None if steps0 is None or steps1 is None else steps1 - steps0,
        # the longest rollout's generated tokens plus one step per turn
        "floor_steps": max(sum(t.completion.num_tokens + 1 for t in r.turns) for r in rollouts),
        "ttft_ms": metric["time_to_first_token_ms"],
        "queue_ms": metric["queue_time_ms"],
        "overhead_ms": [round_trip[c.request_id] - e for c, e in zip(turns, engine_ms)],
    }


PER_BATCH = ("seconds", "tokens", "turns_per_rollout", "engine_steps", "floor_steps")
"""What the JSON keeps of each timed batch."""


def summarize(batches: list[dict], gpu_busy: float | None) -> dict:
    """One row: means over the timed batches, percentiles over all their turns."""

    def pct(key: str, q: float) -> float | None:
        values = np.concatenate([b[key] for b in batches]).astype(float)
        return float(np.nanpercentile(values, q)) if np.isfinite(values).any() else None

    seconds = [b["seconds"] for b in batches]
    steps = [b["engine_steps"] for b in batches]
    return {
        "s_per_batch": float(np.mean(seconds)), "min_s": min(seconds),
        "tokens_per_s": sum(b["tokens"] for b in batches) / sum(seconds),
        "engine_steps": None if None in steps else float(np.mean(steps)),
        "floor_steps": float(np.mean([b["floor_steps"] for b in batches])),
        **{f"{k}_p{q}_ms": pct(f"{k}_ms", q)
           for k in ("ttft", "queue", "overhead") for q in (50, 99)},
        "gpu_busy": gpu_busy, "errors": sum(b["errors"] for b in batches),
        "batches": [{k: b[k] for k in PER_BATCH} for b in batches],
    }  # fmt: skip


def start_folder(cfg, vocab_size: int, folder: Path) -> str:
    """What the vllm backend starts from: model.hf_checkpoint, else a random init with
    job.seed exported in the generator's dtype (the trainer's initial policy, controller-style)."""
    import torch

    from torchtitan_rl.models.hf_export import export_hf
    from torchtitan_rl.models.qwen3 import build_model

    if cfg.generator.backend != "vllm" or cfg.model.hf_checkpoint:
        return cfg.model.hf_checkpoint
    torch.manual_seed(cfg.job.seed)  # as TrainerCore does before building its model
    model = build_model(cfg.model, vocab_size, torch.device("cpu"))
    export_hf(model.state_dict(), model.model_args, folder, dtype=cfg.generator.dtype)
    return str(folder)


async def run_backend(cfg, placement, args, scratch: Path) -> list[dict]:
    """Spawn the backend's generator(s), run every rollout count, close everything."""
    from monarch.actor import this_host

    from torchtitan_rl.actors.generate_fn import ActorGenerateFn
    from torchtitan_rl.controller.launcher import spawn_generators, stop_meshes
    from torchtitan_rl.controller.processes import kill_leftovers, on_this_machine
    from torchtitan_rl.envs import build_environment
    from torchtitan_rl.models.renderer import Renderer
    from torchtitan_rl.models.tokenizer import Tokenizer
    from torchtitan_rl.rollout.rollouter import Rollouter
    from torchtitan_rl.rollout.router import Router

    tokenizer = Tokenizer.from_file(cfg.model.hf_checkpoint or None)
    renderer, replicas = Renderer(tokenizer), cfg.generator.num_replicas
    environment = build_environment(cfg.env, cfg.job.seed, cfg.env_args())
    hf_folder = start_folder(cfg, tokenizer.vocab_size, scratch / "hf")
    kind, host = "gpus" if placement.trainer else "procs", this_host()
    meshes = [host.spawn_procs(per_host={kind: 1}) for _ in range(replicas)]
    names = ["generator", *(f"generator{i}" for i in range(1, replicas))]
    generators, local, rows = [], [], []
    try:
        generators = spawn_generators(
            meshes, names, cfg, vocab_size=tokenizer.vocab_size, log_dir=str(scratch / "logs"),
            hf_folder=hf_folder, placement=placement,
        )  # fmt: skip
        local = on_this_machine(await asyncio.gather(*(g.where.call_one() for g in generators)))
        timers = [
            TimedGenerateFn(ActorGenerateFn(g, n), continue_cut=not args.cut_ends_rollout)
            for g, n in zip(generators, names)
        ]
        generate_fn = Router(timers) if replicas > 1 else timers[0]
        gpu = placement.generators[0] if placement.gpus else None
        for rollouts in args.rollouts:
            prompts = rollouts // cfg.rollout.group_size
            rollout_cfg = dataclasses.replace(
                cfg.rollout, prompts_per_step=prompts, filter_zero_std_groups=False
            )
            rollouter = Rollouter(environment, renderer, cfg.env, rollout_cfg, cfg.job.seed)
            batches, busy = [], None
            for b in range(args.batches):
                busy = GpuBusy(gpu) if b == args.skip else busy
                batches.append(
                    await run_batch(rollouter, generate_fn, timers, generators, b + 1, b * prompts)
                )
                print(f"{cfg.generator.backend} {rollouts} rollouts, batch {b + 1}: "
                      f"{batches[-1]['seconds']:.3f} s", flush=True)  # fmt: skip
            summary = summarize(batches[args.skip :], busy.stop())
            rows.append({"backend": cfg.generator.backend, "rollouts": rollouts, **summary})
    finally:
        for g in generators:
            try:
                await asyncio.wait_for(g.close.call_one(), timeout=30)
            except Exception as e:  # a dead or stuck actor: its process is killed below
                print(f"closing a generator: {e}", file=sys.stderr)
        await stop_meshes(meshes)
        await kill_leftovers(local)
    return rows


def load(args, backend: str):
    from torchtitan_rl.config import load_config

    overrides = [f"--{kv}" for kv in args.set] + [f"--generator.backend={backend}"]
    return load_config(ROOT / args.config, overrides)


def commit() -> str:
    """The checkout the imported package comes from (a baseline run imports an older one)."""
    import torchtitan_rl

    where = Path(torchtitan_rl.__file__).resolve().parents[1]
    git = ["git", "-C", str(where)]
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return sha.strip()[:12] + ("-dirty" if dirty.stdout.strip() else "")


def print_table(rows: list[dict]) -> None:
    vllm = {r["rollouts"]: r["s_per_batch"] for r in rows if r["backend"] == "vllm"}
    for r in rows:  # vLLM's seconds per batch over this backend's: > 1 is faster than vLLM
        r["vs_vllm"] = vllm[r["rollouts"]] / r["s_per_batch"] if r["rollouts"] in vllm else None
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        cells = ["n/a" if r.get(k) is None else f.format(r[k]) for k, f in COLUMNS.items()]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    from torchtitan_rl.controller.placement import plan

    args = parse_args()
    configs = {}
    for backend in args.backends:
        try:
            cfg = load(args, backend)
            placement = plan(cfg.parallelism, cfg.generator.num_replicas, backend)
        except ValueError as e:  # ConfigError or no room: one line naming the key
            fail(str(e).splitlines()[0])
        configs[backend] = (cfg, placement)
        group = cfg.rollout.group_size
        if any(n < 1 or n % group for n in args.rollouts):
            fail(f"--rollouts {args.rollouts}: each a multiple of rollout.group_size={group}")
    cut = "ends its rollout" if args.cut_ends_rollout else "goes on to the next env turn"
    print("weights: random init, no trainer and no warm start (native: its own init; vllm: an "
          "init with job.seed, or model.hf_checkpoint if set); every group kept; a turn cut "
          f"at max_tokens {cut}", flush=True)  # fmt: skip
    rows = []
    for backend, (cfg, placement) in configs.items():
        with tempfile.TemporaryDirectory(prefix=f"bench_rollout_{backend}_") as scratch:
            rows += asyncio.run(run_backend(cfg, placement, args, Path(scratch)))
    print_table(rows)
    if any(r["errors"] for r in rows):
        print("warning: some rollouts errored (column `errors` in the JSON)")
    out = Path(args.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    result = {"label": args.label, "commit": commit(), "config": args.config, "set": args.set,
              "weights": "random init, no trainer", "skip": args.skip,
              "cut_ends_rollout": args.cut_ends_rollout, "rows": rows}  # fmt: skip
    (out / "bench_rollout_pattern.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'bench_rollout_pattern.json'}")


if __name__ == "__main__":
    main()
    leave(0)  # skips Monarch's exit hook, which can time out after a run (see `leave`)
