"""The one-screen summary printed at the end of a run."""

from __future__ import annotations

from pathlib import Path

from torchtitan_rl.controller.metrics import MetricsLogger, first_last_mean
from torchtitan_rl.controller.processes import process_lines

SUMMARY_TAGS = ("rollout_reward/mean", "validation_reward/mean", "perf/step_seconds")
"""The series the summary reads; checkpoints carry them so a resumed run's summary covers
the whole run."""


def summary_lines(m: MetricsLogger, run_dir: Path, wall_seconds: float) -> list[str]:
    """The run's summary from the metrics it logged (`m`) and what lies in `run_dir`."""
    reward = m.series("rollout_reward/mean")
    k = max(1, min(5, len(reward) // 2))  # first and last k never overlap
    first, last = first_last_mean(reward, k)
    val = m.series("validation_reward/mean")
    ran = len(m.series("perf/step_seconds"))  # a step whose rollouts all errored logs no reward
    lines = [
        "=" * 64,
        f"run      {run_dir}",
        f"steps    {ran} RL steps, wall time {wall_seconds:.0f} s",
        f"reward   rollout_reward/mean first {k} steps {first:.3f} -> last {k} steps {last:.3f}",
    ]
    if val:
        lines.append(
            f"validate validation_reward/mean {val[0]:.3f} (before RL) -> {val[-1]:.3f} (end)"
            f"  [{len(val)} evaluations]"
        )
    step_s = m.series("perf/step_seconds")
    if step_s:
        lines.append(f"speed    {sum(step_s) / len(step_s):.2f} s/step on average")
    lines += process_lines(run_dir)
    lines += [
        f"logs     tensorboard --logdir {m.tb_dir}",
        f"config   {run_dir / 'config.toml'}",
    ]
    for name, what in (
        ("hf", "policy as a Hugging Face folder"),
        ("rollouts", "best/worst rollouts per step: python scripts/show_rollouts.py <run>"),
        ("checkpoints", "rerunning the same command resumes from the latest"),
        ("errors.log", "tracebacks of rollouts that errored"),
    ):
        if (run_dir / name).exists():
            lines.append(f"{name + '/' if name != 'errors.log' else name:<8} {what}")
    lines.append("=" * 64)
    return lines


def print_summary(m: MetricsLogger, run_dir: Path, wall_seconds: float) -> None:
    print("\n".join(summary_lines(m, run_dir, wall_seconds)))
