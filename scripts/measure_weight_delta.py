"""What fraction of the bf16 weight bytes a generator receives actually change per RL step:
the question a delta weight sync (send only what changed) rests on.

    python scripts/measure_weight_delta.py                       # tiny model, CPU, ~1 min
    python scripts/measure_weight_delta.py train_configs/alphabet_sort_qwen3_0.6b.toml \\
        --steps 8 --warm_start.steps=60                          # the 0.6B job (a GPU host)

Runs the job (the config file plus any --section.key=value overrides) through the real
controller: start, warm start, then --steps RL steps. After the start and after every RL step
it takes the trainer's packed weights in bfloat16 (`publish_weights`: the exact buffer a bf16
generator is sent) and compares each version with the one before, element by element (2-byte
words; a delta transport would send changed words plus their positions) and byte by byte.
The fp32 master weights move every step; a bf16 word changes only when the update carries
the value across a bf16 rounding boundary, so the fraction depends on the learning rate,
the optimizer and the weight magnitudes.

Writes weight_delta.json to --out (default: $OUT, else the current directory).

Measured 2026-11-26 on the 2-core VM (CPU, torch 2.13.0+cpu), tiny Qwen3 (2.4 MB of bf16
weights), 50 warm-start steps, then 5 RL steps with AdamW at a constant learning rate:
  python scripts/measure_weight_delta.py --steps 5 --warm_start.steps=50 \
      --validation.interval=0 --training.warmup_steps=0 --training.lr=<lr>

| training.lr | bf16 words changed per RL step, steps 1-5 | after 5 steps |
|-------------|--------------------------------------------|---------------|
| 3e-4 (the 0.6B config's lr) | 81.3%, 72.7%, 67.9%, 63.5%, 60.9% | 78.7% |
| 1e-6 (common in LLM RL)     | 2.7%, 1.8%, 1.4%, 1.3%, 1.2%      | 4.9%  |

(The tiny config's own lr 4e-4 with its 20-step warmup: 26.0% to 37.8% per step.) An Adam
step moves every weight by about lr, so whether its bf16 word changes depends on lr against
the bf16 spacing at the weight's magnitude (2^-8 relative). At this project's learning rates
most words change every step on the tiny model. The 0.6B shape on one H200 (2026-11-26, the
second command above, lr 3e-4): 33.3% of words changed in RL step 1, 15.6% by step 8
(docs/hosts.md): what the delta transport (`weight_sync.transport = "delta"`: a bitmask plus
the changed values, 1/16 of the bf16 buffer plus 2 bytes per changed word) rests on;
scripts/bench_weight_sync.py --changed times it at such fractions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import torch

from torchtitan_rl.train import leave

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", default=str(ROOT / "train_configs/alphabet_sort_tiny.toml"))
    p.add_argument("--steps", type=int, default=5, help="RL steps to measure")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON")
    p.add_argument("--run-dir", default="/tmp/measure_weight_delta", help="job.output_dir")
    args, overrides = p.parse_known_args(argv)
    return args, overrides


def changed(before: torch.Tensor, after: torch.Tensor) -> dict[str, float]:
    """Fractions of bf16 words and of bytes that differ between two packed buffers."""
    words = before.view(torch.int16) != after.view(torch.int16)
    nbytes = before.view(torch.uint8) != after.view(torch.uint8)
    return {
        "words_changed": float(words.float().mean()),
        "bytes_changed": float(nbytes.float().mean()),
        "changed_words": int(words.sum()),
    }


def per_tensor(before, after, layout) -> list[tuple[str, float]]:
    """(name, fraction of its words changed), largest tensors first; aliases once."""
    rows, seen = [], set()
    for name, shape, start in layout:
        if start in seen:
            continue
        seen.add(start)
        n = 1
        for s in shape:
            n *= s
        diff = before[start : start + n].view(torch.int16) != after[start : start + n].view(
            torch.int16
        )
        rows.append((name, n, float(diff.float().mean())))
    rows.sort(key=lambda r: -r[1])
    return [(name, frac) for name, _, frac in rows]


async def measure(config, steps: int) -> dict:
    from torchtitan_rl.controller.loop import Controller

    controller = Controller(config, use_tqdm=False)

    async def bf16():
        out = await controller.trainer.publish_weights.call("bfloat16")
        return [p for p in out.values() if p is not None][0]

    try:
        await controller.start()
        await controller.warm_start()
        previous = await bf16()
        first = previous
        rows = []
        for step in range(1, steps + 1):
            metrics = await controller.rl_step(step)
            current = await bf16()
            row = {"step": step, "policy_version": current.version}
            row.update(changed(previous.flat_P, current.flat_P))
            row["lr"] = metrics.get("trainer/lr")
            row["tensors"] = per_tensor(previous.flat_P, current.flat_P, current.layout)[:5]
            rows.append(row)
            print(
                f"step {step}: {row['words_changed']:.2%} of bf16 words changed, "
                f"{row['bytes_changed']:.2%} of bytes",
                flush=True,
            )
            previous = current
        return {
            "weight_bytes": first.nbytes,
            "steps": rows,
            "since_start": changed(first.flat_P, previous.flat_P),
        }
    finally:
        await controller.close()


def main(argv: list[str]) -> int:
    from torchtitan_rl.config import ConfigError, load_config

    args, overrides = parse_args(argv)
    try:
        config = load_config(
            args.config,
            [
                f"--job.output_dir={args.run_dir}",
                "--job.run_name=weight_delta",
                f"--training.steps={args.steps}",
                "--checkpoint.interval=0",
                *overrides,
            ],
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # a fresh run every time (a checkpoint left by an earlier one would be resumed)
    import shutil

    shutil.rmtree(Path(args.run_dir) / "weight_delta", ignore_errors=True)
    result = asyncio.run(measure(config, args.steps))
    result.update(
        config=args.config, overrides=overrides, lr=config.training.lr, torch=torch.__version__
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_delta.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    print(
        f"\n{Path(result['config']).name} {' '.join(result['overrides'])}: "
        f"{result['weight_bytes'] / 1e6:,.1f} MB of bf16 weights, training.lr={result['lr']}"
    )
    print(f"| {'RL step':>7} | {'lr':>9} | {'bf16 words changed':>18} | {'bytes changed':>13} |")
    print(f"|{'-' * 9}|{'-' * 11}|{'-' * 20}|{'-' * 15}|")
    for row in result["steps"]:
        print(
            f"| {row['step']:>7} | {row['lr'] or 0:>9.2e} | {row['words_changed']:>17.2%} | "
            f"{row['bytes_changed']:>12.2%} |"
        )
    total = result["since_start"]
    print(
        f"| {'all':>7} | {'':>9} | {total['words_changed']:>17.2%} | "
        f"{total['bytes_changed']:>12.2%} |  (before step 1 vs after the last)"
    )


if __name__ == "__main__":
    leave(main(sys.argv[1:]) or 0)  # skips Monarch's exit hook (see `leave`)
