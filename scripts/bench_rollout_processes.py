"""The controller's share of a step with rollout.processes: its CPU per turn when it plays
every turn itself, against K rollout processes playing the groups.

    python scripts/bench_rollout_processes.py --rollouts 256 768 --processes 0 1 2

Real Monarch processes throughout: `--replicas` fake generator actors (each answers a turn
at once with 128 random token ids, as a random-weight policy at rollout.max_tokens = 128
does), and the real Rollouter, AlphabetSort environment, renderer and tokenizer of a job file
(default the 0.6B GPU job: 3 turns, groups of 8), zero-std filter off, so a step is one
round. processes = 0: the controller's loop plays every turn, through the Router and
ActorGenerateFn as a run does; K >= 1: `RolloutProcesses` (controller/rollout_processes.py),
the controller making one call per group. Per row, the best of `--repeats` batches (by wall)
after a warm-up batch: wall seconds, the controller's CPU (this process, Monarch's threads
included) per turn, and the rollout processes' and the fake generators' CPU per turn (from
/proc). On a host with fewer cores than processes the wall time is bounded by the cores;
the controller's CPU per turn is what bounds the turn rate of one controller on a host with
cores to spare (docs/benchmarks.md, "The controller's turn rate").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from monarch.actor import Actor, endpoint, this_host

from torchtitan_rl.train import leave
from torchtitan_rl.types import Completion, FinishReason

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "train_configs/alphabet_sort_qwen3_0.6b.toml"
COMPLETION_TOKENS = 128
COLUMNS = {
    "rollout.processes": ("processes", "{}"),
    "rollouts": ("rollouts", "{}"),
    "turns": ("turns", "{:,}"),
    "seconds": ("seconds", "{:.3f}"),
    "turns / s": ("turns_per_s", "{:,.0f}"),
    "controller CPU ms / turn": ("controller_cpu_ms_per_turn", "{:.3f}"),
    "rollout processes' CPU ms / turn": ("processes_cpu_ms_per_turn", "{:.3f}"),
    "generators' CPU ms / turn": ("generators_cpu_ms_per_turn", "{:.3f}"),
}
"""Table header -> (row key, format)."""


class FakeGenerator(Actor):
    """Answers each turn at once with COMPLETION_TOKENS random ids below `vocab`."""

    def __init__(self, vocab: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    @endpoint
    async def generate(self, prompt_ids, request_id, session_id, sampling) -> Completion:
        ids = self.rng.integers(0, self.vocab, COMPLETION_TOKENS).astype(np.int32)
        return Completion(
            request_id=request_id,
            token_ids_N=ids,
            logprobs_N=np.full(COMPLETION_TOKENS, -1.0, np.float32),
            finish_reason=FinishReason.STOP,
        )

    @endpoint
    async def where(self) -> dict:
        return {"pid": os.getpid()}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="job file")
    p.add_argument("--rollouts", type=int, nargs="+", default=[256, 768], help="per batch")
    p.add_argument("--processes", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--replicas", type=int, default=2, help="fake generator actors")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per row (best kept)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the JSON")
    p.add_argument("--smoke", action="store_true", help="16 rollouts, one timed batch")
    return p.parse_args()


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes `pids` have used, from /proc."""
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        utime, stime = stat.rsplit(")", 1)[1].split()[11:13]
        total += int(utime) + int(stime)
    return total / os.sysconf("SC_CLK_TCK")


async def run_row(args, generators, gen_pids, rollouts: int, processes: int) -> dict:
    from torchtitan_rl.actors.generate_fn import ActorGenerateFn
    from torchtitan_rl.config.loader import load_config
    from torchtitan_rl.controller.rollout_processes import RolloutProcesses
    from torchtitan_rl.envs import build_environment
    from torchtitan_rl.models.renderer import Renderer
    from torchtitan_rl.models.tokenizer import Tokenizer
    from torchtitan_rl.rollout.rollouter import Rollouter
    from torchtitan_rl.rollout.router import Router

    probe = load_config(args.config, [])
    prompts = max(1, rollouts // probe.rollout.group_size)
    cfg = load_config(
        args.config,
        [
            f"--rollout.prompts_per_step={prompts}",
            "--rollout.filter_zero_std_groups=false",
            f"--rollout.processes={processes}",
        ],
    )
    renderer = Renderer(Tokenizer.from_file(cfg.model.hf_checkpoint or None))
    environment = build_environment(cfg.env, cfg.job.seed, cfg.env_args())
    rollouter = Rollouter(environment, renderer, cfg.env, cfg.rollout, cfg.job.seed)
    names = [f"generator{i}" for i in range(len(generators))]
    router = Router([ActorGenerateFn(g, n) for g, n in zip(generators, names, strict=True)])
    procs, proc_pids, play = None, [], None
    if processes:
        procs = RolloutProcesses(cfg, log_dir=None)
        replicas = [SimpleNamespace(actor=g, name=n) for g, n in zip(generators, names)]
        await procs.start(SimpleNamespace(replicas=replicas, survives=False))
        proc_pids = [(await a.where.call_one())["pid"] for a in procs.actors]
        play = procs.play_group

    async def batch(step: int) -> tuple:
        start, cpu = time.perf_counter(), time.process_time()
        procs_cpu, gens_cpu = cpu_s(proc_pids), cpu_s(gen_pids)
        got = await rollouter.collect_batch(step, 0, router, play_group=play)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        done = [r for g in got.groups for r in g.rollouts]
        errors = [r.error for r in done if r.status.is_error()]
        assert not errors, errors[0]
        turns = sum(len(r.turns) for r in done)
        return (seconds, cpu, cpu_s(proc_pids) - procs_cpu, cpu_s(gen_pids) - gens_cpu,
                len(done), turns)  # fmt: skip

    try:
        await batch(0)  # warm-up
        timed = [await batch(1 + i) for i in range(args.repeats)]
    finally:
        rollouter.close()
        if procs is not None:
            await procs.close()
    seconds, cpu, procs_cpu, gens_cpu, n, turns = min(timed)
    return {
        "processes": processes, "rollouts": n, "turns": turns, "seconds": seconds,
        "turns_per_s": turns / seconds, "controller_cpu_ms_per_turn": 1e3 * cpu / turns,
        "processes_cpu_ms_per_turn": 1e3 * procs_cpu / turns,
        "generators_cpu_ms_per_turn": 1e3 * gens_cpu / turns,
    }  # fmt: skip


async def amain(args) -> list[dict]:
    from torchtitan_rl.config.loader import load_config
    from torchtitan_rl.models.tokenizer import Tokenizer

    cfg = load_config(args.config, [])
    vocab = min(Tokenizer.from_file(cfg.model.hf_checkpoint or None).vocab_size, 150_000)
    host = this_host()
    meshes = [host.spawn_procs(per_host={"procs": 1}) for _ in range(args.replicas)]
    generators = [m.spawn(f"generator{i}", FakeGenerator, vocab, i) for i, m in enumerate(meshes)]
    gen_pids = [(await g.where.call_one())["pid"] for g in generators]
    rows = []
    for processes in args.processes:
        for n in args.rollouts:
            rows.append(await run_row(args, generators, gen_pids, n, processes))
    for mesh in meshes:
        await mesh.stop()
    return rows


def main() -> None:
    args = parse_args()
    if args.smoke:
        args.rollouts, args.repeats, args.processes = [16], 1, [0, 1]
    rows = asyncio.run(amain(args))
    cores = len(os.sched_getaffinity(0))
    print(f"{args.config}; {args.replicas} fake generator actors answering at once with "
          f"{COMPLETION_TOKENS} random tokens; {cores} cores")  # fmt: skip
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        print("| " + " | ".join(f.format(r[key]) for key, f in COLUMNS.values()) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rollout_processes.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
    leave(0)  # skips Monarch's exit hook, which can time out after a run (see `leave`)
