"""Full training vs LoRA on one GPU: trainer and generator peak memory, seconds per RL step,
seconds and bytes per weight sync.

    python scripts/bench_lora.py --flavors 0.6B --modes full lora [--steps 10] [--out DIR]
    python scripts/bench_lora.py --flavors 8B --modes lora

Each (flavor, mode) is one `./run_train.sh` run, one after another on the same GPU:
AlphabetSort, a random-init Qwen3 of that shape (model.flavor), trainer and generator sharing
the GPU, bf16 everywhere, no warm start, `--steps` RL steps. LoRA: rank 8 on every
projection. Per run: exit code, the trainer's and the generator's peak reserved GPU memory
(processes.json), mean perf/step_seconds and perf/sync_seconds over the steps after the
second (the first ones compile), and the bytes one sync moves: every weight in bf16 (the
generators get merged weights) against the adapters' bytes an adapter-only sync would move.
Prints a table and writes lora.json; a run that fails (e.g. full training out of memory)
is a row with its error's last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from summarize_run import read_scalars  # noqa: E402

COMMON = (
    "--parallelism.device=cuda", "--parallelism.trainer_procs=1", "--warm_start.steps=0",
    "--validation.interval=0", "--checkpoint.interval=0", "--training.dtype=bfloat16",
    "--generator.dtype=bfloat16", "--rollout.prompts_per_step=16", "--rollout.group_size=4",
    "--rollout.filter_zero_std_groups=false", "--generator.max_num_seqs=64",
)  # fmt: skip


def adapter_bytes(flavor: str, rank: int) -> tuple[int, int]:
    """(all parameters, LoRA parameters at `rank` on the 7 projections) of a flavor."""
    from types import SimpleNamespace

    from torchtitan.models.qwen3 import qwen3_args

    from torchtitan_rl.models.qwen3 import BUILTIN_ARGS
    from torchtitan_rl.models.tokenizer import Tokenizer

    builtin = BUILTIN_ARGS.get(flavor)
    args = SimpleNamespace(**builtin) if builtin else qwen3_args[flavor]
    dim, hidden, layers = args.dim, args.hidden_dim, args.n_layers
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    shapes = [(dim, q), (dim, kv), (dim, kv), (q, dim), (dim, hidden), (dim, hidden), (hidden, dim)]
    lora = layers * sum(rank * (i + o) for i, o in shapes)
    vocab = Tokenizer.from_file(None).vocab_size
    base = layers * sum(i * o for i, o in shapes) + 2 * vocab * dim
    return base, lora


def run(flavor: str, mode: str, steps: int, out: Path) -> dict:
    name = f"{flavor}_{mode}"
    args = [*COMMON, f"--model.flavor={flavor}", f"--training.steps={steps}",
            f"--job.output_dir={out}", f"--job.run_name={name}"]  # fmt: skip
    if mode == "lora":
        args.append("--lora.rank=8")
    t0 = time.perf_counter()
    proc = subprocess.run([str(ROOT / "run_train.sh"), *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    row = {"flavor": flavor, "mode": mode, "rc": proc.returncode, "wall_s": round(wall, 1)}
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        return {**row, "error": lines[-1] if lines else ""}
    run_dir = out / name
    scalars = read_scalars(run_dir / "tb")
    later = lambda tag: [v for s, v in scalars.get(tag, []) if s > 2]  # noqa: E731
    processes = json.loads((run_dir / "processes.json").read_text())
    peak = {w["role"]: w.get("peak_reserved_gib") for w in processes}
    base, lora = adapter_bytes(flavor, 8)
    return {
        **row,
        "step_s": round(sum(later("perf/step_seconds")) / max(len(later("perf/step_seconds")), 1), 3),
        "sync_s": round(sum(later("perf/sync_seconds")) / max(len(later("perf/sync_seconds")), 1), 3),
        "trainer_peak_gib": peak.get("trainer"), "generator_peak_gib": peak.get("generator"),
        "sync_mb_merged": round(2 * base / 1e6, 1), "sync_mb_adapters": round(2 * lora / 1e6, 1),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavors", nargs="+", default=["0.6B"])
    p.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=os.environ.get("OUT", "outputs/bench_lora"))
    p.add_argument("--smoke", action="store_true", help="the tiny shape on CPU, 3 steps")
    a = p.parse_args()
    if a.smoke:
        global COMMON
        COMMON = (*COMMON, "--parallelism.device=cpu", "--training.dtype=float32",
                  "--generator.dtype=float32", "--rollout.prompts_per_step=4")  # fmt: skip
        a.flavors, a.steps = ["tiny"], 3
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for flavor in a.flavors:
        for mode in a.modes:
            rows.append(run(flavor, mode, a.steps, out))
            print(json.dumps(rows[-1]), flush=True)
            (out / "lora.json").write_text(json.dumps(rows, indent=1))
    keys = ["flavor", "mode", "rc", "step_s", "sync_s", "trainer_peak_gib",
            "generator_peak_gib", "sync_mb_merged", "sync_mb_adapters", "wall_s"]  # fmt: skip
    print(" | ".join(keys))
    for r in rows:
        print(
            " | ".join(str(r.get(k, "")) for k in keys)
            + (f"  {r['error']}" if "error" in r else "")
        )


if __name__ == "__main__":
    main()
