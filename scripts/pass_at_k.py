"""Solved share of samples (pass@1) and of groups (pass@k: at least one of the group's k
samples solved) over bins of RL steps, from a run's rollout records.

python scripts/pass_at_k.py outputs/countdown_tiny --bin 50 --solved 1.0

Each step's records keep every trained group's rewards (`group_rewards`); with
`rollout.filter_zero_std_groups = true` the groups that scored alike are not trained, so
they are missing and both shares are those of the mixed groups only.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_rl.rollout.records import read_records  # noqa: E402


def pass_rates(run: Path, bin_steps: int, solved: float) -> list[tuple[int, int, float, float]]:
    """(first step, groups, pass@1, pass@k) for each bin of `bin_steps` steps."""
    groups: dict[int, dict[tuple[int, int], list[float]]] = {}
    for path in (run / "rollouts").glob("step_*.jsonl"):
        step = int(re.fullmatch(r"step_(\d+)\.jsonl", path.name).group(1))
        for record in read_records(path):
            key = (step, record["group_id"])
            groups.setdefault((step - 1) // bin_steps, {})[key] = record["group_rewards"]
    rows = []
    for b in sorted(groups):
        rewards = list(groups[b].values())
        hits = [[r >= solved for r in g] for g in rewards]
        pass1 = sum(sum(h) / len(h) for h in hits) / len(hits)
        passk = sum(any(h) for h in hits) / len(hits)
        rows.append((b * bin_steps + 1, len(hits), pass1, passk))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path, help="the run's folder (holds rollouts/)")
    p.add_argument("--bin", type=int, default=50, help="RL steps per row")
    p.add_argument("--solved", type=float, default=1.0, help="a reward at least this is solved")
    args = p.parse_args()
    print("| steps | groups | pass@1 | pass@k |\n|---|---|---|---|")
    for first, n, pass1, passk in pass_rates(args.run, args.bin, args.solved):
        print(f"| {first}-{first + args.bin - 1} | {n} | {pass1:.3f} | {passk:.3f} |")


if __name__ == "__main__":
    main()
