"""How long `ProcMesh.stop()` takes for one Monarch worker process.

    python scripts/bench_worker_stop.py --repeats 3

Each row spawns one process on this host with a small actor, waits until the actor has
imported what it is asked to, then times `stop()` of its proc mesh (the controller's close
does this for every trainer, generator and rollout process). Rows:
- `floor`: the actor imports nothing (Monarch's own stop of a bare process);
- `finalize`: the actor imports the generator actor's module (torch, torchtitan, the
  engine), as every worker does, and the process ends through the interpreter's
  finalization (before `exit_at_stop`);
- `exit_at_stop`: the same imports, then `torchtitan_rl.actors.process_exit.exit_at_stop()`,
  as the trainer, generator and rollout actors call at start.
Means and extremes over `--repeats` processes per row; JSON to $OUT/bench_worker_stop.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from monarch.actor import Actor, endpoint, this_host

from torchtitan_rl.train import leave

ROWS = ("floor", "finalize", "exit_at_stop")


class Worker(Actor):
    @endpoint
    async def prepare(self, row: str) -> float:
        """Imports what `row` needs; returns the seconds it took."""
        t0 = time.perf_counter()
        if row != "floor":
            import torchtitan_rl.actors.generator  # noqa: F401
        if row == "exit_at_stop":
            from torchtitan_rl.actors.process_exit import exit_at_stop

            exit_at_stop()
        return time.perf_counter() - t0


async def one(row: str) -> tuple[float, float]:
    procs = this_host().spawn_procs(per_host={"procs": 1})
    worker = procs.spawn("worker", Worker)
    imported = await worker.prepare.call_one(row)
    t0 = time.perf_counter()
    await procs.stop()
    return imported, time.perf_counter() - t0


async def run(repeats: int) -> list[dict]:
    rows = []
    for row in ROWS:
        imports, stops = zip(*[await one(row) for _ in range(repeats)])
        rows.append(
            {"row": row, "stop_s": statistics.mean(stops), "min_s": min(stops),
             "max_s": max(stops), "import_s": statistics.mean(imports)}
        )  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="processes per row")
    p.add_argument("--smoke", action="store_true", help="one process per row")
    args = p.parse_args()
    rows = asyncio.run(run(1 if args.smoke else args.repeats))
    print("| row | stop s (mean) | min | max | imports s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['stop_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} | "
              f"{r['import_s']:.2f} |")  # fmt: skip
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_worker_stop.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
    leave(0)
