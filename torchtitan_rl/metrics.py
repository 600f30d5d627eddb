"""Step metrics: one reduction per step, written to TensorBoard and kept for the summary."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np


def summarize(prefix: str, values: Iterable[float]) -> dict[str, float]:
    """{prefix/mean, /std, /max} of finite values; nothing when there are none."""
    arr = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    if arr.size == 0:
        return {}
    return {f"{prefix}/mean": arr.mean(), f"{prefix}/std": arr.std(), f"{prefix}/max": arr.max()}


class MetricsLogger:
    """Writes scalars under <run_dir>/tb/ and remembers them per tag for the final summary."""

    def __init__(self, run_dir: Path, purge_step: int | None = None):
        """`purge_step`: on resume, hide events a killed run logged at steps >= it."""
        from torch.utils.tensorboard import SummaryWriter

        self.tb_dir = run_dir / "tb"
        self.writer = SummaryWriter(log_dir=str(self.tb_dir), purge_step=purge_step)
        self.history: dict[str, list[tuple[int, float]]] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            value = float(value)
            self.writer.add_scalar(tag, value, step)
            self.history.setdefault(tag, []).append((step, value))
        self.writer.flush()

    def series(self, tag: str) -> list[float]:
        return [v for _, v in self.history.get(tag, [])]

    def close(self) -> None:
        self.writer.close()


def first_last_mean(values: list[float], k: int = 5) -> tuple[float, float]:
    """Mean of the first k and of the last k values (nan when empty)."""
    if not values:
        return float("nan"), float("nan")
    return float(np.mean(values[:k])), float(np.mean(values[-k:]))
