"""Pretty-print rollout records written during training.

python scripts/show_rollouts.py outputs/alphabet_sort_tiny            # the latest step
python scripts/show_rollouts.py outputs/alphabet_sort_tiny --step 12 --pick worst
python scripts/show_rollouts.py outputs/alphabet_sort_tiny/rollouts/step_12.jsonl
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_rl.rollout.records import read_records  # noqa: E402

WIDTH = 100


def find_file(target: Path, step: int | None) -> Path:
    if target.is_file():
        return target
    folder = target / "rollouts" if (target / "rollouts").is_dir() else target
    files = {
        int(m.group(1)): p
        for p in folder.glob("step_*.jsonl")
        if (m := re.fullmatch(r"step_(\d+)\.jsonl", p.name))
    }
    if not files:
        raise SystemExit(f"error: no rollout records (step_<N>.jsonl) under {folder}")
    if step is None:
        return files[max(files)]
    if step not in files:
        raise SystemExit(f"error: no records for step {step}; steps with records: {sorted(files)}")
    return files[step]


def _block(role: str, text: str) -> list[str]:
    body = text.splitlines() or [""]
    lines = [f"  [{role}]"]
    for line in body:
        lines += textwrap.wrap(line, WIDTH, initial_indent="    ", subsequent_indent="    ") or [
            "    "
        ]
    return lines


def format_record(r: dict) -> str:
    versions = f"v{r['policy_version_min']}" + (
        f"-{r['policy_version_max']}" if r["policy_version_max"] != r["policy_version_min"] else ""
    )
    rewards = ", ".join("err" if x is None else f"{x:.2f}" for x in r["group_rewards"])
    head = (
        f"step {r['step']}  group {r['group_id']}  rollout {r['rollout_id']}  ({r['pick']})  "
        f"status {r['status']}  reward {r['reward']:.3f}  advantage {r['advantage']:+.3f}  "
        f"weights {versions} (optimizer updates so far, warm start included)"
    )
    lines = ["=" * WIDTH, head, f"  group rewards [{rewards}]"]
    if r["reward_breakdown"]:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["reward_breakdown"].items())
        lines.append(f"  breakdown {parts}")
    if r["error"]:
        lines.append(f"  error: {r['error']}")
    turns = iter(r["turns"])
    for m in r["messages"]:
        lines += _block(m["role"], m["content"])
        turn = next(turns, None) if m["role"] == "assistant" else None
        if turn is not None:  # each turn's numbers right under its assistant message
            signals = ", ".join(f"{k} {v:.3f}" for k, v in turn["reward_signals"].items())
            lines.append(
                f"  -> turn {turn['turn']}: {turn['num_tokens']} tokens, "
                f"finish {turn['finish_reason']}" + (f", {signals}" if signals else "")
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "target", type=Path, help="run folder, its rollouts/ folder, or a .jsonl file"
    )
    parser.add_argument("--step", type=int, default=None, help="RL step (default: the latest)")
    parser.add_argument("--pick", choices=("best", "worst"), default=None, help="only best/worst")
    parser.add_argument("--group", type=int, default=None, help="only this group id")
    args = parser.parse_args(argv)
    path = find_file(args.target, args.step)
    records = read_records(path)
    if args.pick:
        records = [r for r in records if args.pick in r["pick"].split("+")]
    if args.group is not None:
        records = [r for r in records if r["group_id"] == args.group]
    print(f"{path}: {len(records)} rollouts")
    for r in records:
        print(format_record(r))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # piped into `head`: stop quietly, as other CLI tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
