"""What `loss.old_logprobs = "recompute"` costs, next to "generator", in real runs.

Runs the same job twice through `run_train.sh` (same seed, same steps), once per mode, and
prints per RL step: training seconds, the pi_old forward's seconds (recompute only) and its
share of training, and the mismatch the trainer measured between its log-probs and the
generator's (bf16 generator vs fp32-master trainer in the GPU config).

    python scripts/bench_old_logprobs.py                      # the 0.6B GPU config
    python scripts/bench_old_logprobs.py --config train_configs/alphabet_sort_tiny.toml \
        --steps 6 --warm-start 20 --json out.json

The floor for the recompute pass is a forward without backward: about a third of the
training step's arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from summarize_run import read_scalars, summarize  # noqa: E402

MODES = ("recompute", "generator")
COLUMNS = (
    ("train s", "perf/train_seconds", 1.0),
    ("pi_old ms", "perf/old_logprobs_seconds", 1e3),
    ("gen s", "perf/generate_seconds", 1.0),
    ("|diff| mean", "trainer/logprob_diff/mean", 1.0),
    ("|diff| max", "trainer/logprob_diff/max", 1.0),
    ("ratio mean", "loss/ratio_mean", 1.0),
    ("clip frac", "loss/clip_frac", 1.0),
)


def run(mode: str, args, out_dir: Path) -> dict[str, dict[str, float]]:
    overrides = [
        f"--job.output_dir={out_dir}",
        f"--job.run_name={mode}",
        f"--training.steps={args.steps}",
        f"--warm_start.steps={args.warm_start}",
        "--validation.interval=0",
        "--checkpoint.interval=0",
        "--rollout.filter_zero_std_groups=false",
        f"--loss.old_logprobs={mode}",
        *args.override,
    ]
    env = {**os.environ, "CONFIG_FILE": str(args.config)}
    subprocess.run([str(ROOT / "run_train.sh"), *overrides], check=True, env=env, cwd=ROOT)
    return summarize(read_scalars(out_dir / mode / "tb"))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", type=Path, default=ROOT / "train_configs/alphabet_sort_qwen3_0.6b.toml"
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warm-start", type=int, default=60)
    parser.add_argument("--override", action="append", default=[], help="--section.key=value")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            rows[mode] = run(mode, args, Path(tmp))
    print(f"{args.config.name}, {args.steps} RL steps, means over steps 2..{args.steps}")
    header = f"| {'loss.old_logprobs':<17} | " + " | ".join(f"{c:>11}" for c, _, _ in COLUMNS)
    print(header + f" | {'pi_old share':>12} |")
    print("|" + "-" * (len(header) + 14) + "|")
    for mode, summary in rows.items():
        cells = []
        for _, tag, scale in COLUMNS:
            value = summary.get(tag, {}).get("mean_wo_first", float("nan"))
            cells.append(f"{value * scale:>11.4f}")
        train = summary.get("perf/train_seconds", {}).get("mean_wo_first", float("nan"))
        old = summary.get("perf/old_logprobs_seconds", {}).get("mean_wo_first", float("nan"))
        print(f"| {mode:<17} | " + " | ".join(cells) + f" | {old / train:>12.1%} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
