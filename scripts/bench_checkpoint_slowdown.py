"""Training step time before and after a checkpoint save, in a one-rank gloo trainer on CPU.

    python scripts/bench_checkpoint_slowdown.py [--threads 2] [--steps 10]
    python scripts/bench_checkpoint_slowdown.py --smoke   # tiny model, 8 sequences, 1 step

Each row runs in a fresh process: the small built-in model, `--threads` torch threads, a
one-rank gloo process group (as a one-process CPU trainer has), a batch of 44 random
sequences of 82 tokens (a Countdown step's kept samples, each packed whole); it times
`--steps` train steps, saves the trainer state one way, and times `--steps` more. Rows:

- `save_trainer_state` (ours): DCP without collectives in a group of one (`no_dist`);
- `dcp.save with collectives` (DCP's default in a process group, what the trainer did before);
- `gloo all_gather of 1 MB`: no checkpoint, one large gloo collective, the trigger alone.

The "before" column is the floor: the same steps with nothing saved. Measured 2026-11-25 on
the 2-core x86_64 VM, torch 2.13.0+cpu, 2 threads, 10 steps (README).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "ours": "save_trainer_state (no collectives in a group of one)",
    "dist": "dcp.save with collectives (DCP default)",
    "gloo": "gloo all_gather of 1 MB, no checkpoint",
}


def run_mode(mode: str, threads: int, steps: int, flavor: str, sequences: int = 44) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 1000))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")
    from torchtitan_rl.losses.corrections import CorrectionConfig
    from torchtitan_rl.losses.policy_loss import LossConfig
    from torchtitan_rl.models.qwen3 import ModelConfig
    from torchtitan_rl.rollout.batcher import BatcherConfig, pack_batch
    from torchtitan_rl.training.checkpoint import save_trainer_state, trainer_state
    from torchtitan_rl.training.trainer import TrainerCore
    from torchtitan_rl.training.trainer_config import TrainingConfig
    from torchtitan_rl.types import Episode

    vocab = 896
    core = TrainerCore(
        model_config=ModelConfig(flavor=flavor, max_seq_len=512),
        training=TrainingConfig(lr=1e-5),
        loss=LossConfig(),
        correction=CorrectionConfig(),
        vocab_size=vocab,
        device=torch.device("cpu"),
        seed=0,
    )
    rng = np.random.default_rng(0)
    episodes = []
    for i in range(sequences):
        mask = np.arange(82) >= 69
        episodes.append(
            Episode(
                token_ids_L=rng.integers(0, vocab, 82).astype(np.int32),
                loss_mask_L=mask,
                logprobs_L=np.where(mask, -3.0, 0).astype(np.float32),
                advantages_L=np.where(mask, 1.0 if i % 2 else -1.0, 0).astype(np.float32),
                rollout_id=i,
            )
        )
    config = BatcherConfig(seq_len=256, rows_per_microbatch=4)
    batch = pack_batch(episodes, config=config, num_ranks=1, pad_id=0)[0][0]

    def timed() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            core.train_step([batch], temperature=1.0)
        return (time.perf_counter() - start) / steps

    timed()  # warm-up
    before = timed()
    with tempfile.TemporaryDirectory() as tmp:
        if mode == "ours":
            save_trainer_state(core, Path(tmp) / "trainer")
        elif mode == "dist":
            dcp.save(trainer_state(core), checkpoint_id=str(Path(tmp) / "trainer"))
        else:
            payload = torch.zeros(1 << 20, dtype=torch.uint8)
            dist.all_gather([torch.empty_like(payload)], payload)
    return {"before_s": before, "after_s": timed()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny model, 8 sequences, 1 step")
    p.add_argument("--flavor", default="small", help=argparse.SUPPRESS)
    p.add_argument("--sequences", type=int, default=44, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one row, in a child
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.smoke:
        args.flavor, args.steps, args.sequences = "tiny", 1, 8
    if args.mode:
        print(
            json.dumps(run_mode(args.mode, args.threads, args.steps, args.flavor, args.sequences))
        )
        return
    rows = {}
    for mode in MODES:
        child = [sys.executable, __file__, "--mode", mode]
        child += ["--threads", str(args.threads), "--steps", str(args.steps)]
        child += ["--flavor", args.flavor, "--sequences", str(args.sequences)]
        done = subprocess.run(child, capture_output=True, text=True, cwd=ROOT, check=True)
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"train step, {args.flavor} model, {args.threads} threads, one-rank gloo group (s/step)")
    print(f"| {'after':<55} | before (floor) | after | slower |")
    print(f"|{'-' * 57}|----------------|-------|--------|")
    for mode, r in rows.items():
        slower = r["after_s"] / r["before_s"] - 1
        print(
            f"| {MODES[mode]:<55} | {r['before_s']:14.3f} | {r['after_s']:5.3f} | {slower:+6.0%} |"
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_checkpoint_slowdown.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
