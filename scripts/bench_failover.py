"""Kill a generator replica at random moments of a seeded run; every run must finish, train
the same prompts as the undisturbed run, and leave nothing running.

    python scripts/bench_failover.py --kills 5 --staleness 0 1 [--backend vllm] [--out DIR]

For each max_staleness, one undisturbed run, then `--kills` runs that SIGKILL a random replica
(of 2) at a random moment in the first `--kill_by` share of the undisturbed run's RL time.
Per run: whether the kill came before the run ended, whether it finished, whether the
prompts trained per step equal the undisturbed run's, and (CPU, pipelined: the engine is
batch-invariant) whether every reward and loss is equal bit for bit; requests rerouted,
seconds until the fleet heard of the death and until the replica rejoined, and processes
left running. `--look on off` runs each kill moment twice, the second time with the fleet's
look at its processes on this host switched off (Monarch's report of the death only).
Prints a table and writes failover.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import tempfile
import time
from pathlib import Path

from torchtitan_rl.config import load_config
from torchtitan_rl.controller.loop import Controller
from torchtitan_rl.controller.processes import started
from torchtitan_rl.train import leave

ROOT = Path(__file__).resolve().parents[1]
EXACT = ("rollout_reward/mean", "loss/mean", "loss/policy", "trainer/grad_norm")


def config(out: Path, name: str, args, staleness: int):
    return load_config(
        ROOT / "train_configs" / "alphabet_sort_tiny.toml",
        [
            f"--job.output_dir={out}", f"--job.run_name={name}",
            f"--training.steps={args.steps}", "--warm_start.steps=2",
            "--warm_start.batch_size=4", "--rollout.prompts_per_step=8",
            "--rollout.filter_zero_std_groups=false", "--rollout.max_tokens=16",
            "--validation.interval=0", "--checkpoint.interval=0",
            "--parallelism.trainer_procs=1", "--generator.num_replicas=2",
            f"--generator.backend={args.backend}", f"--parallelism.device={args.device}",
            f"--rollout.max_staleness={staleness}", *args.overrides,
        ],
    )  # fmt: skip


def run(cfg, kill_after_s: float | None, victim: int, look: bool = True) -> dict:
    """One run; kills replica `victim` `kill_after_s` seconds into RL step 1. `look`: False
    switches off the fleet's look at its processes on this host (Monarch's report only)."""
    controller = Controller(cfg, use_tqdm=False)
    if not look:
        controller.fleet._mark_gone_here = lambda: None
    trained: dict[int, list[int]] = {}
    train = controller.stage.train

    async def recording_train(trainer, groups):
        trained[controller.start_step + len(trained) + 1] = sorted(g.sample_index for g in groups)
        return await train(trainer, groups)

    controller.stage.train = recording_train
    killed: dict = {}
    rl_start: list[float] = []

    async def watch_rl_start():
        while controller.supervisor.where != "during RL step 1":
            await asyncio.sleep(0.01)
        rl_start.append(time.perf_counter())

    async def kill():
        while not rl_start:
            await asyncio.sleep(0.01)
        await asyncio.sleep(kill_after_s)
        replica = controller.fleet.replicas[victim]
        killed["pid"] = await replica.actor.pid.call_one()
        killed["at_s"], killed["name"] = kill_after_s, replica.name
        os.kill(killed["pid"], signal.SIGKILL)
        t_kill = time.perf_counter()
        while replica.up:  # until the fleet hears of the death
            await asyncio.sleep(0.01)
        killed["heard_s"] = round(time.perf_counter() - t_kill, 2)
        while not replica.up:  # until the restarted process took the weights and rejoined
            await asyncio.sleep(0.01)
        killed["rejoin_s"] = round(time.perf_counter() - t_kill, 1)

    async def go():
        t0 = time.perf_counter()
        killer = asyncio.ensure_future(kill()) if kill_after_s is not None else None
        rl = asyncio.ensure_future(watch_rl_start())
        error = None
        try:
            await controller.run()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            if killer is not None:
                killer.cancel()
            rl.cancel()
            rl_seconds = time.perf_counter() - (rl_start[0] if rl_start else t0)
            await controller.close()
        return error, rl_seconds

    error, seconds = asyncio.run(go())
    history = {
        t: dict(s) for t, s in (controller.metrics.history if controller.metrics else {}).items()
    }
    fleet = controller.fleet
    leftover = [w["pid"] for w, t in controller.local_processes + fleet.local_processes
                if started(w["pid"]) == t]  # fmt: skip
    if "pid" in killed and started(killed["pid"]) is not None:
        leftover.append(killed["pid"])
    return {
        "error": error, "seconds": seconds, "trained": trained, "killed": killed,
        "rerouted": sum(history.get("generator/requests_rerouted", {}).values()),
        "alive_at_end": history.get("generator/replicas_alive", {}).get(cfg.training.steps),
        "heard_s": killed.get("heard_s"), "rejoin_s": killed.get("rejoin_s"),
        "exact": {t: history.get(t, {}) for t in EXACT}, "leftover": leftover,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--backend", default="native")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kill_by", type=float, default=0.9,
        help="kill moments fall in this share of the undisturbed RL time (small: time to rejoin)",
    )  # fmt: skip
    parser.add_argument(
        "--look", nargs="+", choices=["on", "off"], default=["on"],
        help="each kill moment with the fleet's look at its local processes on, and/or off",
    )  # fmt: skip
    parser.add_argument("--overrides", nargs="*", default=[], help="more --key=value for every run")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="one kill, N = 1, 3 RL steps")
    args = parser.parse_args()
    if args.smoke:
        args.kills, args.staleness, args.steps = 1, [1], 3
    logging.basicConfig(
        level=logging.WARNING, format="%(relativeCreated)9.0f ms %(name)s %(message)s"
    )
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="failover_"))
    rows = []
    for staleness in args.staleness:
        base = run(config(work, f"n{staleness}_base", args, staleness), None, 0)
        assert base["error"] is None, base["error"]
        span = base["seconds"] * args.kill_by  # within the RL steps (seconds counts from step 1)
        for k, look in ((k, look) for k in range(args.kills) for look in args.look):
            if look == args.look[0]:
                at, victim = round(rng.uniform(0.0, span), 2), rng.randrange(2)
            name = f"n{staleness}_kill{k}_look_{look}"
            r = run(config(work, name, args, staleness), at, victim, look == "on")
            rows.append({
                "max_staleness": staleness, "kill": k, "look": look, "at_s": at, "victim": victim,
                "killed": bool(r["killed"]), "finished": r["error"] is None, "error": r["error"],
                "same_prompts": r["trained"] == base["trained"],
                "bit_equal": r["exact"] == base["exact"], "rerouted": r["rerouted"],
                "alive_at_end": r["alive_at_end"], "heard_s": r["heard_s"], "rejoin_s": r["rejoin_s"],
                "leftover": r["leftover"],
                "seconds": round(r["seconds"], 1), "base_seconds": round(base["seconds"], 1),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    keys = ["max_staleness", "kill", "look", "at_s", "victim", "killed", "finished", "same_prompts",
            "bit_equal", "rerouted", "alive_at_end", "heard_s", "rejoin_s", "leftover", "seconds"]  # fmt: skip
    print("| " + " | ".join(keys) + " |")
    for r in rows:
        cells = [len(r[k]) if k == "leftover" else r[k] for k in keys]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "failover.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
    leave(0)  # skips Monarch's exit hook, which can time out after a run (see `leave`)
