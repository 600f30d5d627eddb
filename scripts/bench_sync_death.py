"""A generator replica killed just as an RL step's weight sync starts: how long that sync
takes to give up on it and go on over the live replica.

    python scripts/bench_sync_death.py --repeats 3 [--out DIR]

Rows, alternating in each repeat: "ours" (the fleet looks at the replicas' processes on this
host while the weights go out) and "Monarch's report" (the fleet waits for Monarch's report
of the death, as it did before; the process check switched off). The tiny AlphabetSort job
on CPU, 2 native replicas, max_staleness = 1; replica 1 is SIGKILLed when the first RL step's
sync starts. Prints a table and writes sync_death.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from bench_failover import config

from torchtitan_rl.controller.loop import Controller
from torchtitan_rl.train import leave

SYNCS_BEFORE_RL = 2
"""The start's sync and the warm start's; the next one is RL step 1's."""


def run(work: Path, name: str, steps: int, monarch_only: bool) -> dict:
    args = argparse.Namespace(steps=steps, backend="native", device="cpu", overrides=[])
    controller = Controller(config(work, name, args, 1), use_tqdm=False)
    fleet, seen = controller.fleet, {}
    if monarch_only:
        fleet._mark_gone_here = lambda: None
    inner, calls = fleet._sync, []

    async def sync():
        calls.append(None)
        if len(calls) != SYNCS_BEFORE_RL + 1:
            return await inner()
        os.kill(await fleet.replicas[1].actor.pid.call_one(), signal.SIGKILL)
        t0 = time.perf_counter()
        try:
            return await inner()
        finally:
            seen["sync_s"] = time.perf_counter() - t0

    fleet._sync = sync

    async def go():
        try:
            await controller.run()
        finally:
            await controller.close()

    error = None
    try:
        asyncio.run(go())
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return {"row": "Monarch's report" if monarch_only else "ours", "error": error, **seen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="one repeat of our row, 2 RL steps")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.steps = 1, 2
    logging.basicConfig(level=logging.ERROR, format="%(name)s %(message)s")
    work = Path(tempfile.mkdtemp(prefix="sync_death_"))
    runs = []
    # the smoke leaves out the row that waits ~10 s for Monarch's report
    modes = (False,) if args.smoke else (False, True)
    for k in range(args.repeats):
        for monarch_only in modes:
            runs.append(run(work, f"r{k}_{int(monarch_only)}", args.steps, monarch_only))
            print(json.dumps(runs[-1]), flush=True)
    print("| row | sync with the death, s (median) | each | errors |")
    print("|---|---|---|---|")
    for row in ("ours", "Monarch's report"):
        mine = [r for r in runs if r["row"] == row]
        secs = [r["sync_s"] for r in mine if "sync_s" in r]
        median = f"{statistics.median(secs):.2f}" if secs else "-"
        each = " ".join(f"{s:.2f}" for s in secs)
        print(f"| {row} | {median} | {each} | {sum(r['error'] is not None for r in mine)} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_death.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
    leave(0)  # skips Monarch's exit hook, which can time out after a run (see `leave`)
