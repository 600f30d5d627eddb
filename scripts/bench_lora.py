"""Full training vs LoRA with trainer and generator sharing one GPU: each process's peak GPU
memory and their sum, seconds per RL step, seconds and bytes per weight sync.

    python scripts/bench_lora.py --shapes 8B --memory-cap-gib 74.5   # 8B LoRA on 80 GB
    python scripts/bench_lora.py --shapes 0.6B 4B --memory-cap-gib 74.5
    python scripts/bench_lora.py --shapes 4B --modes lora [--steps 10] [--out DIR]
    python scripts/bench_lora.py --shapes 0.6B --generator-bases device host [--compile]
    python scripts/bench_lora.py --shapes 8B --split                  # 2 GPUs, max_staleness 1
    python scripts/bench_lora.py --smoke                              # tiny shape, CPU

Each (shape, mode) is one `./run_train.sh` run, one after another on the same GPU:
AlphabetSort, a random-init Qwen3 of that shape (model.flavor), trainer and native
generator on one GPU, bf16 everywhere, no warm start, `--steps` RL steps. Modes: "full"
and "lora" (rank 8 on every projection, adapter-only syncs); by default both, except for
the 8B shape: LoRA only (full training holds fp32 weights, gradients and two Adam moments,
16 bytes x 6.95e9 parameters at this vocabulary = 104 GiB).

`--memory-cap-gib G` caps each process (`training.gpu_memory_gib`,
`generator.gpu_memory_gib`; `--trainer-share` of G for the trainer, the rest for the
generator), so a run whose processes need more than G together fails with CUDA out of
memory, whatever the GPU it runs on: 74.5 GiB is an 80 GB GPU.

Shape settings (`SHAPE_ARGS`): the 8B shape's KV cache holds what this job runs at once
(`generator.num_blocks = 512`: 64 sequences x ceil((37-token prompt + 48 tokens) / 16) =
384 blocks, plus room; the default, 64 x 512 tokens = 2048 blocks, is 4.5 GiB at 8B).

`--generator-bases`: a LoRA run per `lora.generator_base` given (default: auto only), each
a row "lora/<base>"; `--compile`: `training.compile = true` in every run (the blocks,
adapters included, compiled by Inductor; default: eager, as the default config); `--split`:
the trainer on GPU 0 and the generator on GPU 1 (`parallelism.placement = "split"`), one
step in flight (`rollout.max_staleness = 1`), so generation overlaps training.

Per run: exit code, the trainer's and the generator's peak reserved GPU memory at the end
(processes.json) and their sum, mean perf/step_seconds and perf/sync_seconds over the steps
after the second (the first ones compile), the seconds the weight sync took to open (with
LoRA: the one-time base sync), the MB one sync moves (full: every weight in bf16; LoRA: the
adapters in fp32) and, with LoRA, the MB the generator copies from host to device per sync
(the base of every adapted weight with `lora.generator_base = "host"`, 0 with "device";
"auto" picks one at run time, so its row leaves it blank). Prints a table and writes
lora.json; a run that fails (e.g. out of memory under the cap) is a row with its error.
The end-of-run exports (hf/, hf_adapter/: 28 GB at 8B in bf16) are deleted once a run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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
    "--checkpoint.export_dtype=bfloat16",  # the end-of-run export, deleted once read
    "--debug",  # the controller's log lines: the weight sync's opening time
)  # fmt: skip
SMOKE = (
    "--parallelism.device=cpu", "--training.dtype=float32", "--generator.dtype=float32",
    "--rollout.prompts_per_step=4",
)  # fmt: skip
"""--smoke: the tiny shape on CPU, after COMMON (later overrides win)."""
SHAPE_ARGS = {"8B": ("--generator.num_blocks=512",)}
"""Overrides of one shape (module docstring)."""
MODES = {"8B": ("lora",)}
"""Modes a shape runs by default (else full and lora)."""
LORA_RANK = 8


SPLIT = ("--parallelism.placement=split", "--rollout.max_staleness=1")
"""--split: trainer and generator on GPUs of their own, one step in flight."""


def sizes(shape: str, rank: int) -> dict[str, int]:
    """Elements of a shape: every distinct weight ("all"), the weights LoRA adapts
    ("adapted") and their adapters at `rank` ("adapters"), from the model built on the meta
    device."""
    import torch

    from torchtitan_rl.models.lora import TARGETS
    from torchtitan_rl.models.qwen3 import ModelConfig, PolicyModel, model_args
    from torchtitan_rl.models.tokenizer import Tokenizer

    vocab = Tokenizer.from_file(None).vocab_size
    with torch.device("meta"):
        model = PolicyModel(model_args(ModelConfig(flavor=shape), vocab))
    adapted = [
        block.get_submodule(path).weight
        for block in model.layers.values()
        for path, _ in TARGETS.values()
    ]  # fmt: skip
    return {
        "all": sum(p.numel() for p in model.parameters()),
        "adapted": sum(w.numel() for w in adapted),
        "adapters": sum(rank * (w.shape[0] + w.shape[1]) for w in adapted),
    }


def caps(total_gib: float, trainer_share: float) -> tuple[str, ...]:
    """The two processes' caps for `--memory-cap-gib` (none for 0)."""
    if not total_gib:
        return ()
    trainer = round(total_gib * trainer_share, 2)
    return (f"--training.gpu_memory_gib={trainer}",
            f"--generator.gpu_memory_gib={round(total_gib - trainer, 2)}")  # fmt: skip


def run(shape: str, mode: str, extra: tuple[str, ...], steps: int, out: Path) -> dict:
    """One run; `mode`: "full", or "lora/<lora.generator_base>"."""
    name = f"{shape}_{mode.replace('/', '_')}"
    args = [*COMMON, *SHAPE_ARGS.get(shape, ()), *extra, f"--model.flavor={shape}",
            f"--training.steps={steps}", f"--job.output_dir={out}", f"--job.run_name={name}"]  # fmt: skip
    lora, _, base = mode.partition("/")
    if lora == "lora":
        args += [f"--lora.rank={LORA_RANK}", f"--lora.generator_base={base}"]
    t0 = time.perf_counter()
    proc = subprocess.run([str(ROOT / "run_train.sh"), *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    (out / f"{name}.log").write_text(log)
    row = {"shape": shape, "mode": mode, "rc": proc.returncode, "wall_s": round(wall, 1)}
    if proc.returncode != 0:  # the out-of-memory line if there is one, else the last
        lines = [x.strip() for x in proc.stderr.splitlines() if x.strip()]
        oom = [x for x in lines if "out of memory" in x.lower()]
        error = oom[0] if oom else lines[-1] if lines else ""
        return {**row, "error": error[:300]}
    run_dir = out / name
    for folder in ("hf", "hf_adapter"):  # the 8B shape's: 28 GB, on a 64 GiB disk
        shutil.rmtree(run_dir / folder, ignore_errors=True)
    scalars = read_scalars(run_dir / "tb")
    later = lambda tag: [v for s, v in scalars.get(tag, []) if s > 2]  # noqa: E731
    mean = lambda xs: round(sum(xs) / max(len(xs), 1), 3)  # noqa: E731
    processes = json.loads((run_dir / "processes.json").read_text())
    peak = {w["role"]: w.get("peak_reserved_gib") for w in processes}
    opened = re.search(r"weight sync: .*; opened in ([0-9.]+) s", log)
    n = sizes(shape, LORA_RANK)
    lora = lora == "lora"
    h2d = {"host": round(2 * n["adapted"] / 1e6, 1), "device": 0.0}.get(base)
    both = [peak.get("trainer"), peak.get("generator")]
    return {
        **row,
        "step_s": mean(later("perf/step_seconds")), "sync_s": mean(later("perf/sync_seconds")),
        "open_s": float(opened.group(1)) if opened else None,
        "trainer_peak_gib": both[0], "generator_peak_gib": both[1],
        "sum_peak_gib": round(sum(both), 2) if None not in both else None,
        "sync_mb": round((4 * n["adapters"] + 4 if lora else 2 * n["all"]) / 1e6, 1),
        "h2d_mb": h2d if lora else None,
    }  # fmt: skip


def _expand(mode: str, bases: list[str]) -> list[str]:
    """A LoRA mode becomes one "lora/<base>" per `lora.generator_base` asked for."""
    return [f"lora/{b}" for b in bases] if mode == "lora" else [mode]


def main() -> None:
    global COMMON
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", "--flavors", nargs="+", default=["0.6B"], help="model.flavor values")
    p.add_argument("--modes", nargs="+", choices=["full", "lora"],
                   help="default: full and lora (8B: lora)")  # fmt: skip
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--memory-cap-gib", type=float, default=0.0,
                   help="cap on both processes together, split by --trainer-share (0: none)")  # fmt: skip
    p.add_argument("--trainer-share", type=float, default=0.5)
    p.add_argument("--out", default=os.environ.get("OUT", "outputs/bench_lora"))
    p.add_argument("--generator-bases", nargs="+", default=["auto"],
                   choices=["auto", "device", "host"], help="lora.generator_base of LoRA runs")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="training.compile = true")
    p.add_argument("--split", action="store_true", help="trainer GPU + generator GPU, N = 1")
    p.add_argument("--smoke", action="store_true", help="the tiny shape on CPU, 3 steps")
    a = p.parse_args()
    if a.smoke:
        COMMON = (*COMMON, *SMOKE)
        a.shapes, a.steps = ["tiny"], 3
    if not 0 < a.trainer_share < 1:
        p.error(f"--trainer-share must be in (0, 1), got {a.trainer_share}")
    extra = caps(a.memory_cap_gib, a.trainer_share)
    if a.compile:
        extra = (*extra, "--training.compile=true")
    if a.split:
        extra = (*extra, *SPLIT)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in a.shapes:
        modes = a.modes or MODES.get(shape, ("full", "lora"))
        modes = [m for mode in modes for m in _expand(mode, a.generator_bases)]
        for mode in modes:
            row = {**run(shape, mode, extra, a.steps, out), "cap_gib": a.memory_cap_gib}
            rows.append({**row, "layout": "1+1" if a.split else "shared"})
            print(json.dumps(rows[-1]), flush=True)
            (out / "lora.json").write_text(json.dumps(rows, indent=1))
    keys = ["shape", "mode", "layout", "rc", "cap_gib", "trainer_peak_gib", "generator_peak_gib",
            "sum_peak_gib", "step_s", "sync_s", "open_s", "sync_mb", "h2d_mb", "wall_s"]  # fmt: skip
    print(" | ".join(keys))
    for r in rows:
        print(
            " | ".join(str(r.get(k, "")) for k in keys)
            + (f"  {r['error']}" if "error" in r else "")
        )


if __name__ == "__main__":
    main()
