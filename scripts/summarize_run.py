"""Summarise a run's TensorBoard folder: seconds per RL step by stage, the mismatch, the reward.

    python scripts/summarize_run.py outputs/alphabet_sort_tiny            # a run folder
    python scripts/summarize_run.py outputs/alphabet_sort_tiny/tb --json out.json

Reads the scalars the controller logs at RL steps >= 1 (warm start logs at steps <= 0 and
is left out). "mean" is over every RL step; "mean w/o 1st" leaves out step 1, which pays
one-time costs (torch.compile, autotuning, CUDA graph capture) and so is shown apart.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

PERF_TAGS = (
    "perf/generate_seconds",
    "perf/train_seconds",
    "perf/sync_seconds",
    "perf/step_seconds",
)
"""Stage timings, in seconds per RL step; step = generate + train + sync (+ bookkeeping)."""
OLD_LOGPROB_TAGS = ("perf/old_logprobs_seconds",)
"""Part of perf/train_seconds spent recomputing pi_old (loss.old_logprobs = "recompute")."""
MISMATCH_TAGS = (
    "trainer/logprob_diff/mean",
    "trainer/logprob_diff/max",
    "loss/ratio_mean",
    "loss/clip_frac",
)
"""Generator-vs-trainer log-prob gap and the PPO ratio the update saw."""
REWARD_TAGS = ("rollout_reward/mean", "validation_reward/mean")


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} sorted by step; a later event at a step replaces one
    logged earlier (a resumed run re-logs the steps after its checkpoint)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        by_step = {e.step: e.value for e in acc.Scalars(tag)}
        out[tag] = sorted(by_step.items())
    return out


def summarize(scalars: dict[str, list[tuple[int, float]]]) -> dict[str, dict[str, float]]:
    """Per tag: steps, mean, mean without step 1, first and last value (RL steps only)."""
    rows = {}
    for tag in (*PERF_TAGS, *OLD_LOGPROB_TAGS, *MISMATCH_TAGS, *REWARD_TAGS):
        series = [(s, v) for s, v in scalars.get(tag, []) if s >= 0 and math.isfinite(v)]
        if tag.startswith("perf/"):
            series = [(s, v) for s, v in series if s >= 1]
        if not series:
            continue
        values = [v for _, v in series]
        later = [v for s, v in series if s > 1]
        rows[tag] = {
            "steps": len(values),
            "mean": statistics.fmean(values),
            "mean_wo_first": statistics.fmean(later) if later else float("nan"),
            "first": values[0],
            "last": values[-1],
        }
    return rows


def format_table(rows: dict[str, dict[str, float]], title: str) -> str:
    lines = [
        title,
        f"| {'tag':<26} | {'steps':>5} | {'mean':>8} | {'mean w/o 1st':>12} | "
        f"{'first':>8} | {'last':>8} |",
        f"|{'-' * 28}|{'-' * 7}|{'-' * 10}|{'-' * 14}|{'-' * 10}|{'-' * 10}|",
    ]
    for tag, r in rows.items():
        lines.append(
            f"| {tag:<26} | {r['steps']:>5d} | {r['mean']:>8.3f} | {r['mean_wo_first']:>12.3f} | "
            f"{r['first']:>8.3f} | {r['last']:>8.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder (holding tb/) or its tb folder")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    tb_dir = args.run / "tb" if (args.run / "tb").is_dir() else args.run
    if not tb_dir.is_dir():
        print(f"error: no TensorBoard folder at {tb_dir}", file=sys.stderr)
        return 1
    rows = summarize(read_scalars(tb_dir))
    print(format_table(rows, f"run {tb_dir.parent.name} ({tb_dir})"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
