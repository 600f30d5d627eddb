"""Whether two runs logged the same numbers: every TensorBoard scalar, step by step, bit for
bit, except timings (`perf/*` and the generator's clock-based metrics), which no two runs
share. Prints the tags that differ and exits 1 if any does.

    python scripts/compare_runs.py outputs/run_a outputs/run_b

The check of the README's promise that a seeded run replays bit for bit on CPU (two runs of
the same command into two folders).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summarize_run import read_scalars  # noqa: E402

CLOCK_TAGS = ("perf/", "_ms/", "_seconds", "generator/inflight_at_completion",
              "generator/steps_to_first_token", "rollout/staleness", "generator/engine_",
              "generator/weight_pull", "generator/routed_")  # fmt: skip
"""Tags that measure time or depend on when things happened, not on what was computed."""


def differing(a: Path, b: Path) -> tuple[list[str], int]:
    """(tags whose values differ at any step or are logged by one run only, tags compared)."""
    sa, sb = (read_scalars(p / "tb" if (p / "tb").is_dir() else p) for p in (a, b))
    tags = sorted(t for t in set(sa) | set(sb) if not any(c in t for c in CLOCK_TAGS))
    return [t for t in tags if sa.get(t) != sb.get(t)], len(tags)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    args = p.parse_args()
    bad, compared = differing(args.run_a, args.run_b)
    for tag in bad:
        print(f"differs: {tag}")
    print(f"{compared - len(bad)} of {compared} tags equal bit for bit")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
