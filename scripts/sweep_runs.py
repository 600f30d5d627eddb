"""Run several `./run_train.sh` jobs side by side and tabulate how much RL gained in each.

    python scripts/sweep_runs.py --out outputs/sweep --parallel 4 \\
        --common "--training.steps=500" \\
        --variant "seed0: --job.seed=0" --variant "seed1: --job.seed=1"

Each variant is "name: overrides" and runs as `./run_train.sh <common> <overrides>
--job.output_dir=<out> --job.run_name=<name>` (CONFIG_FILE as in the environment). The table:
validation_reward/mean before the first RL step and at the end, the gain, the best value,
RL steps, wall seconds; `<out>/sweep.json` keeps every series. A failed run is a row with
its exit code and log path, and the sweep goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from summarize_run import read_scalars  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="job.output_dir of every run")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time")
    p.add_argument("--common", default="", help="overrides for every run")
    p.add_argument("--variant", action="append", default=[], help='"name: overrides"')
    p.add_argument("--cpus-per-run", type=int, default=0, help="pin each run to N cores (taskset)")
    return p.parse_args()


def result(out: Path, name: str, rc: int, seconds: float) -> dict:
    row = {"name": name, "rc": rc, "wall_s": round(seconds, 1), "log": str(out / f"{name}.log")}
    tb = out / name / "tb"
    if rc != 0 or not tb.is_dir():
        return row
    series = read_scalars(tb).get("validation_reward/mean", [])
    steps = read_scalars(tb).get("perf/step_seconds", [])
    if series:
        start = [v for s, v in series if s <= 0] or [series[0][1]]
        row.update(
            before=start[-1],
            end=series[-1][1],
            gain=series[-1][1] - start[-1],
            best=max(v for _, v in series),
            rl_steps=len(steps),
            series=series,
        )
    return row


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [v.split(":", 1) for v in args.variant]
    pending = [(n.strip(), shlex.split(args.common) + shlex.split(o)) for n, o in variants]
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    rows, cores = [], sorted(os.sched_getaffinity(0))  # run under taskset to keep cores free
    width = max(args.cpus_per_run, 1)
    free = [cores[i : i + width] for i in range(0, len(cores) - len(cores) % width, width)]
    slots: dict[str, list[int]] = {}
    while pending or running:
        while pending and len(running) < args.parallel:
            name, overrides = pending.pop(0)
            cmd = [str(ROOT / "run_train.sh"), *overrides]
            cmd += [f"--job.output_dir={out}", f"--job.run_name={name}"]
            if args.cpus_per_run:
                slots[name] = free.pop(0)
                cmd = ["taskset", "-c", ",".join(map(str, slots[name])), *cmd]
            log = open(out / f"{name}.log", "w")
            running[name] = (subprocess.Popen(cmd, stdout=log, stderr=log), time.time())
        time.sleep(2)
        for name, (proc, t0) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            if name in slots:
                free.append(slots.pop(name))
            rows.append(result(out, name, proc.returncode, time.time() - t0))
            print_row(rows[-1])
            (out / "sweep.json").write_text(json.dumps(rows, indent=2))
    print(
        "\n| run | before RL | end | gain | best | RL steps | wall s |\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print_row(r, table=True)


def print_row(r: dict, table: bool = False) -> None:
    if "gain" not in r:
        line = f"| {r['name']} | failed (exit {r['rc']}, {r['log']}) | | | | | {r['wall_s']} |"
    else:
        line = (
            f"| {r['name']} | {r['before']:.3f} | {r['end']:.3f} | {r['gain']:+.3f} | "
            f"{r['best']:.3f} | {r['rl_steps']} | {r['wall_s']} |"
        )
    print(line if table else line.replace("|", " ").strip(), flush=True)


if __name__ == "__main__":
    main()
