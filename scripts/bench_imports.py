"""Benchmark: how long each kind of process takes to import what it runs, each in a fresh
interpreter, against torch alone (the floor: every process needs it) and torchtitan's Qwen3
(what the trainer and native generator processes need on top).

    python scripts/bench_imports.py            # 3 fresh interpreters per row, median
    python scripts/bench_imports.py --smoke    # 1 each, two rows

Rows: the config (`./run_train.sh` loads it before anything else: a user's mistake is one
line after it), the controller (`controller.loop`: it names the actor classes to spawn
them), a rollout process's actor module, the trainer's and a generator's actor modules (as
Monarch imports them in their process, before the actor starts), and the trainer's core
(`training.trainer`: what the trainer process imports when its actor starts). Per row:
seconds, modules loaded, and whether torchtitan's package was imported. Writes JSON to
--out (default $OUT/bench_imports.json, else outputs/bench_imports.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from json_out import write_json

ROOT = Path(__file__).resolve().parents[1]
ROWS = {
    "floor: torch": "torch",
    "config": "torchtitan_rl.config",
    "controller": "torchtitan_rl.controller.loop",
    "rollout actor": "torchtitan_rl.actors.rollout",
    "trainer actor": "torchtitan_rl.actors.trainer",
    "generator actor": "torchtitan_rl.actors.generator",
    "trainer core": "torchtitan_rl.training.trainer",
    "torchtitan's Qwen3": "torchtitan.models.qwen3",
}
"""Row -> the module a fresh interpreter imports."""
PROBE = (
    "import sys, time, json; t = time.perf_counter(); import {module}; "
    "print(json.dumps([time.perf_counter() - t, len(sys.modules), "
    "any(m == 'torchtitan' for m in sys.modules)]))"
)


def time_import(module: str) -> tuple[float, int, bool]:
    """(seconds, modules loaded, torchtitan imported) of `import module`, fresh interpreter."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    run = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    seconds, modules, torchtitan = json.loads(run.stdout.strip().splitlines()[-1])
    return seconds, modules, torchtitan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    rows = ["floor: torch", "config"] if args.smoke else list(ROWS)
    repeats = 1 if args.smoke else args.repeats
    results = []
    start = time.perf_counter()
    for row in rows:
        runs = [time_import(ROWS[row]) for _ in range(repeats)]
        results.append(dict(row=row, module=ROWS[row], seconds=statistics.median(r[0] for r in runs),
                            each=[round(r[0], 2) for r in runs], modules=runs[0][1],
                            torchtitan=runs[0][2]))  # fmt: skip
    print(f"\n{os.cpu_count()} cores; median of {repeats} fresh interpreters per row "
          f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
    print("| process imports | module | seconds | each | modules loaded | torchtitan |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['row']} | `{r['module']}` | {r['seconds']:.2f} | "
              f"{' '.join(f'{s:.2f}' for s in r['each'])} | {r['modules']:,} | "
              f"{'yes' if r['torchtitan'] else 'no'} |")  # fmt: skip
    write_json(args.out, "bench_imports.json", dict(cores=os.cpu_count(), rows=results))


if __name__ == "__main__":
    main()
