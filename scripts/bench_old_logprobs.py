"""What `loss.old_logprobs = "recompute"` costs, next to "generator".

Two parts:
- runs: the same job twice through `run_train.sh` (same seed and steps), once per mode:
  per RL step, training seconds, the pi_old forward's seconds (recompute only), and the
  mismatch the trainer measured between its log-probs and the generator's (bf16 generator
  vs the trainer's bf16-compute / fp32-master policy in the GPU config). Real runs differ in
  what they sample after step 1, so their training seconds are only indicative;
- direct (`--direct`, GPU): one TrainerCore of the config's model, a fixed packed batch,
  `train_step` timed in both modes alternately (median of --repeats); the difference is
  the recompute's cost, to compare with its floor, a forward without backward (about a
  third of the step's arithmetic).

    python scripts/bench_old_logprobs.py                  # runs, the 0.6B GPU config
    python scripts/bench_old_logprobs.py --direct         # the in-process timing
    python scripts/bench_old_logprobs.py --smoke          # --direct, tiny model on CPU
    python scripts/bench_old_logprobs.py --config train_configs/alphabet_sort_tiny.toml \
        --steps 6 --warm-start 20 --json out.json
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


def direct(args) -> dict[str, float]:
    """Median train_step seconds per mode on one fixed batch (see the module docstring)."""
    import statistics
    import time

    import numpy as np
    import torch
    import torch.distributed as dist

    from torchtitan_rl.config import load_config
    from torchtitan_rl.models.tokenizer import Tokenizer
    from torchtitan_rl.rollout.batcher import pack_batch
    from torchtitan_rl.training.trainer import TrainerCore
    from torchtitan_rl.types import Episode

    cfg = load_config(args.config, args.override)
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        torch.cuda.set_device(0)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda" if cuda else "cpu")
    vocab = Tokenizer.from_file(cfg.model.hf_checkpoint or None).vocab_size
    core = TrainerCore(
        model_config=cfg.model, training=cfg.training, loss=cfg.loss,
        correction=cfg.correction, vocab_size=vocab, device=device, seed=0,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    length = cfg.batcher.seq_len // args.docs_per_row + 1
    episodes = []
    for i in range(args.rows * args.docs_per_row):
        mask = np.zeros(length, bool)
        mask[length // 4 :] = True
        episodes.append(
            Episode(
                token_ids_L=rng.integers(0, vocab, length).astype(np.int32),
                loss_mask_L=mask,
                logprobs_L=np.where(mask, -rng.exponential(2.0, length), 0).astype(np.float32),
                advantages_L=np.where(mask, rng.normal(), 0).astype(np.float32),
                rollout_id=i,
            )
        )
    batch = pack_batch(episodes, config=cfg.batcher, num_ranks=1, pad_id=0)[0][0]
    times: dict[str, list[float]] = {m: [] for m in MODES}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for rep in range(args.repeats + 2):  # two warm-up rounds: compile, autotune
        for mode in MODES:
            core.loss_config.old_logprobs = mode
            sync()
            t0 = time.perf_counter()
            out = core.train_step([batch], cfg.rollout.temperature)
            sync()
            if rep >= 2:
                times[mode].append(time.perf_counter() - t0)
                if mode == "recompute":
                    times.setdefault("pi_old", []).append(out["perf/old_logprobs_seconds"])
    dist.destroy_process_group()
    result = {k: statistics.median(v) for k, v in times.items()}
    tokens = sum(int(mb.loss_mask_RS.sum()) for mb in batch)
    print(
        f"direct: {len(batch)} microbatch(es) of {cfg.batcher.rows_per_microbatch} x "
        f"{cfg.batcher.seq_len}, {tokens} loss tokens, median of {args.repeats}"
    )
    print(f"| {'train_step':<22} | {'ms':>8} |")
    print(f"|{'-' * 24}|{'-' * 10}|")
    for mode in MODES:
        print(f"| {mode:<22} | {result[mode] * 1e3:>8.1f} |")
    added = result["recompute"] - result["generator"]
    print(
        f"| {'added by recompute':<22} | {added * 1e3:>8.1f} |  "
        f"{added / result['generator']:.1%} of a generator-mode step"
    )
    print(f"| {'pi_old pass (events)':<22} | {result['pi_old'] * 1e3:>8.1f} |")
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", type=Path, default=ROOT / "train_configs/alphabet_sort_qwen3_0.6b.toml"
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warm-start", type=int, default=60)
    parser.add_argument("--override", action="append", default=[], help="--section.key=value")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--direct", action="store_true", help="time train_step in-process")
    parser.add_argument("--smoke", action="store_true", help="--direct, tiny model on CPU")
    parser.add_argument("--rows", type=int, default=8, help="--direct: packed rows")
    parser.add_argument("--docs-per-row", type=int, default=4, help="--direct")
    parser.add_argument("--repeats", type=int, default=10, help="--direct")
    args = parser.parse_args(argv)
    if args.smoke:
        args.direct, args.repeats, args.rows = True, 2, 2
        args.config = ROOT / "train_configs/alphabet_sort_tiny.toml"
        args.override = [*args.override, "--batcher.rows_per_microbatch=2"]
    if args.direct:
        result = direct(args)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return 0
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
