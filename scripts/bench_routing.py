"""Generation over several generator GPUs against one: generated tokens per second of each
layout and rollout count, over the first row's, side by side in one call.

    python scripts/bench_routing.py            # the rows of issue 48's routing goal:
        # 1 + 1 GPUs at 256 rollouts; 1 + 3 at 768 with env.workers=8, with rollout.processes=3
        # (and with both), and 1 + 1 at 256 with rollout.processes=1

A row is "LAYOUT:PROMPTS[:OVERRIDES]" (`--rows`): LAYOUT as bench_async.py's `--layouts`
("1+3": 1 trainer GPU, 3 generator GPUs), PROMPTS the groups per step (x group_size
rollouts), OVERRIDES more `--key=value`s for that row. Every run is bench_async.py's
(`run_one`): the 0.6B job, max_staleness 1 (pipelined), the `--common` flags, the first
`--skip` steps left out. Per row: seconds per step, generation seconds, generated tokens per
second and that over the first row's, engine steps per engine (fewer = fuller batches), the
engines' busy share, and the busiest replica's routed tokens over the mean (1.0 = even).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_async import SMOKE, layout_overrides, run_one  # noqa: E402

from torchtitan_rl.config import load_config  # noqa: E402

ROWS = [
    "1+1:32",
    "1+3:96:--env.workers=8",
    "1+3:96:--rollout.processes=3",
    "1+3:96:--rollout.processes=3 --env.workers=2",
    "1+1:32:--rollout.processes=1",
]
COMMON = (
    "--warm_start.steps=30 --validation.interval=0 --checkpoint.interval=0 "
    "--training.steps=6 --rollout.filter_zero_std_groups=false"
)
COLUMNS = {
    "layout": ("layout", "{}"),
    "rollouts": ("rollouts", "{}"),
    "overrides": ("overrides", "{}"),
    "s / step": ("step_s", "{:.3f}"),
    "generation s": ("gen_s", "{:.3f}"),
    "generated tokens / s": ("gen_tok_s", "{:,.0f}"),
    "vs first row": ("ratio", "{:.2f}x"),
    "engine steps per engine": ("steps_per_engine", "{:.0f}"),
    "engines busy": ("busy", "{:.2f}"),
    "busiest / mean": ("spread", "{:.3f}"),
}
"""Table header -> (row key, format)."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", nargs="+", default=ROWS, help='"LAYOUT:PROMPTS[:OVERRIDES]"')
    p.add_argument("--common", default=COMMON, help="overrides for every run")
    p.add_argument("--skip", type=int, default=3, help="first RL steps left out of the means")
    p.add_argument("--out", default="", help="job.output_dir of every run ($OUT/bench_routing)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU job, 2 rows (1 and 2 replicas)")
    return p.parse_args()


def parse_row(spec: str) -> tuple[str, int, str]:
    """ "1+3:96:--env.workers=8" -> ("1+3", 96, "--env.workers=8")."""
    layout, prompts, *extra = spec.split(":", 2)
    return layout, int(prompts), extra[0] if extra else ""


def main() -> None:
    args = parse_args()
    config = "train_configs/alphabet_sort_qwen3_0.6b.toml"
    if args.smoke:
        # as the GPU rows: the first on one replica; the second on two, with
        # rollout.processes (its ratio to the first, its routing over both replicas)
        args.rows = ["config:2", "config:2:--generator.num_replicas=2 --rollout.processes=1"]
        args.common, args.skip = SMOKE, 0
        config = "train_configs/alphabet_sort_tiny.toml"
    out = Path(args.out or Path(os.environ.get("OUT", "outputs")) / "bench_routing").resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, spec in enumerate(args.rows):
        layout, prompts, extra = parse_row(spec)
        overrides = [
            *shlex.split(args.common), *shlex.split(extra), "--rollout.max_staleness=1",
            f"--rollout.prompts_per_step={prompts}", *layout_overrides(layout),
        ]  # fmt: skip
        row = run_one(out, f"row{i}", overrides, args.skip, config)
        assert row["rc"] == 0, f"{spec}: exit code {row['rc']} (see {out}/row{i}.log)"
        job = load_config(ROOT / config, overrides)
        group_size, replicas = job.rollout.group_size, job.generator.num_replicas
        row |= {"layout": layout, "rollouts": prompts * group_size, "overrides": extra or "-",
                "steps_per_engine": row["eng_steps"] / replicas}  # fmt: skip
        row["ratio"] = row["gen_tok_s"] / rows[0]["gen_tok_s"] if rows else 1.0
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        print("| " + " | ".join(f.format(r[key]) for key, f in COLUMNS.values()) + " |")
    (out / "bench_routing.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
