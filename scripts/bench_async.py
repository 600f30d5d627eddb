"""RL steps side by side: synchronous vs asynchronous (rollout.max_staleness) and one
generator backend against another (--backends native vllm): seconds per step, tokens trained
per second, who waits for whom, time to first token and the generator/trainer log-prob gap.

    python scripts/bench_async.py --out outputs/bench_async \\
        --staleness 0 1 1s 2 --prompts 8 32 --common "--warm_start.steps=60 --training.steps=8"

Runs `./run_train.sh` (CONFIG_FILE as in the environment, default the 0.6B GPU job) once per
(staleness, prompts_per_step) pair, one after another (a staleness "1s" runs rollout.ahead =
"streaming", a plain number "pipelined"), and reads each run's TensorBoard
scalars. `--layouts 1+1 1+3 2+2 1+1:shared` repeats each run per GPU layout (trainer GPUs +
generator GPUs, `parallelism.placement`). The first `--skip` steps pay one-time costs (compile, the pipeline filling) and are
left out of the means. The physical floor of an overlapped step is max(generation, training) + sync: the
synchronous step pays generation + training + sync.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from summarize_run import read_scalars  # noqa: E402

TAGS = {
    "step_s": "perf/step_seconds",
    "gen_s": "perf/generate_seconds",
    "train_s": "perf/train_seconds",
    "sync_s": "perf/sync_seconds",
    "trainer_wait_s": "perf/trainer_wait_seconds",
    "generator_wait_s": "perf/generator_wait_seconds",
    "tokens": "batcher/num_tokens",
    "staleness_max": "rollout/staleness/max",
    "reward": "rollout_reward/mean",
    "ttft_ms": "generator/time_to_first_token_ms/mean",
    "logprob_diff_mean": "trainer/logprob_diff/mean",
    "logprob_diff_max": "trainer/logprob_diff/max",
    "busy": "generator/engine_busy_fraction",
    "pull_ms": "generator/weight_pull_ms",
    "eng_steps": "generator/engine_steps",
    "drained": "generator/engine_drained_steps",
    "eager": "generator/engine_eager_prefills",
    "eager_tok": "generator/engine_eager_prefill_tokens",
    "prefix_hit": "generator/prefix_hit_tokens/mean",
    "preempt": "generator/preemptions/mean",
    "spread": "generator/routed_tokens_max_over_mean",
    "gen_tok_s": "perf/generated_tokens_per_second",
    "rounds": "rollout/num_sampling_rounds",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="", help="job.output_dir of every run ($OUT/bench_async)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU job, 3 steps, staleness 0")
    p.add_argument("--staleness", nargs="+", default=["0", "1", "1s", "2"])
    p.add_argument("--prompts", type=int, nargs="+", default=[8, 32], help="prompts_per_step")
    p.add_argument("--backends", nargs="+", default=["native"], help="generator.backend values")
    p.add_argument(
        "--layouts", nargs="+", default=["config"],
        help='GPU layouts: "T+R" = T trainer GPUs (FSDP) + R generator GPUs (placement split), '
        '"T+R:shared" = the R replicas on the trainer\'s GPUs; "config" = as the job says',
    )  # fmt: skip
    p.add_argument("--common", default="", help="overrides for every run")
    p.add_argument("--skip", type=int, default=2, help="first RL steps left out of the means")
    return p.parse_args()


SMOKE = (
    "--parallelism.device=cpu --parallelism.trainer_procs=1 --warm_start.steps=2 "
    "--training.steps=3 --validation.interval=0 --checkpoint.interval=0 "
    "--rollout.group_size=2 --rollout.max_tokens=16 --validation.max_tokens=16 "
    "--rollout.filter_zero_std_groups=false --generator.max_num_seqs=8"
)
"""A job small enough for the test suite: the tiny model on CPU, 3 RL steps, one trainer
process as the GPU job has (the tiny job's two FSDP processes would double a smoke run's
time on a 2-core VM)."""


def layout_overrides(layout: str) -> list[str]:
    """`--layouts` entry -> overrides: "1+3" -> 1 trainer process, 3 replicas, split."""
    if layout == "config":
        return []
    procs, _, placement = layout.partition(":")
    trainer, replicas = procs.split("+")
    return [f"--parallelism.trainer_procs={trainer}", f"--generator.num_replicas={replicas}",
            f"--parallelism.placement={placement or 'split'}"]  # fmt: skip


def run_one(out: Path, name: str, overrides: list[str], skip: int, config: str) -> dict:
    cmd = ["./run_train.sh", *overrides, f"--job.output_dir={out}", f"--job.run_name={name}"]
    env = {**os.environ, "CONFIG_FILE": os.environ.get("CONFIG_FILE", config)}
    t0 = time.perf_counter()
    with (out / f"{name}.log").open("w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    row = {"name": name, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
    tb = out / name / "tb"
    if rc or not tb.is_dir():
        return row
    scalars = read_scalars(tb)
    for key, tag in TAGS.items():
        values = [v for s, v in scalars.get(tag, []) if s > skip]
        row[key] = statistics.fmean(values) if values else float("nan")
    row["tokens_per_s"] = row["tokens"] / row["step_s"]
    processes = out / name / "processes.json"  # peak GPU memory per process (GiB)
    if processes.exists():
        row["peak_gib"] = [w.get("peak_reserved_gib") for w in json.loads(processes.read_text())]
    row["floor_s"] = max(row["gen_s"], row["train_s"]) + row["sync_s"]
    return row


def main() -> None:
    args = parse_args()
    config = "train_configs/alphabet_sort_qwen3_0.6b.toml"
    if args.smoke:  # one run: rows differ only in overrides (bench_routing's smoke runs
        # run_one at max_staleness 1)
        args.staleness, args.prompts, args.skip = ["0"], [2], 0
        args.common, config = f"{SMOKE} {args.common}", "train_configs/alphabet_sort_tiny.toml"
    out = Path(args.out or Path(os.environ.get("OUT", "outputs")) / "bench_async").resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    runs = itertools.product(args.layouts, args.prompts, args.staleness, args.backends)
    for layout, prompts, n, backend in runs:
        name = f"n{n}_p{prompts}" + (f"_{backend}" if len(args.backends) > 1 else "")
        name += f"_{layout.replace('+', 'p').replace(':', '_')}" if layout != "config" else ""
        ahead = "streaming" if n.endswith("s") else "pipelined"
        overrides = [*shlex.split(args.common), f"--rollout.max_staleness={n.rstrip('s')}",
                     f"--rollout.ahead={ahead}", f"--rollout.prompts_per_step={prompts}",
                     f"--generator.backend={backend}", *layout_overrides(layout)]  # fmt: skip
        row = run_one(out, name, overrides, args.skip, config)
        if args.smoke:  # a smoke checks that the script works: a failed run fails it
            assert row["rc"] == 0, f"{name}: exit code {row['rc']} (see {out}/{name}.log)"
        rows.append(
            {"layout": layout, "backend": backend, "staleness": n, "prompts": prompts, **row}
        )
        print(json.dumps(rows[-1]), flush=True)
    cols = ("layout", "backend", "staleness", "prompts", "step_s", "floor_s", "gen_s", "train_s", "sync_s",
            "trainer_wait_s", "generator_wait_s", "tokens_per_s", "staleness_max", "ttft_ms",
            "logprob_diff_mean", "logprob_diff_max", "peak_gib", "busy", "pull_ms", "eng_steps",
            "drained", "eager", "eager_tok", "prefix_hit", "preempt", "spread", "gen_tok_s", "rounds")  # fmt: skip
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(f"{row.get(c, float('nan')):.3f}" if isinstance(row.get(c), float)
                         else str(row.get(c, "-")) for c in cols))  # fmt: skip
    (out / "bench_async.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
