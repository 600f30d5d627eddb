"""The console's progress bars (tqdm), sized for the terminal they are drawn in."""

from __future__ import annotations

MIN_BAR_COLUMNS = 40
"""Below this a terminal's reported width is not believed (some report 0): use 80."""


def progress_bar(total: int, enabled: bool, desc: str):
    import shutil

    from tqdm import tqdm

    columns = shutil.get_terminal_size(fallback=(80, 24)).columns
    fixed = None if columns >= MIN_BAR_COLUMNS else 80
    return tqdm(
        total=total, desc=desc, unit="step", disable=not enabled,
        dynamic_ncols=fixed is None, ncols=fixed,
    )  # fmt: skip


def rl_postfix(metrics: dict[str, float], last_validation: float) -> dict[str, str]:
    """What the RL bar shows after a step: the step's mean rollout reward, the latest
    validation reward (once there is one), the gradient norm (`-`: the step trained on
    nothing) and packed training tokens per second. Not the loss: a GRPO surrogate sits
    near 0 whether the run learns or not."""
    import math

    def fmt(tag: str, spec: str) -> str:
        value = metrics.get(tag, float("nan"))
        return format(value, spec) if math.isfinite(value) else "-"

    postfix = {"reward": fmt("rollout_reward/mean", ".3f")}
    if math.isfinite(last_validation):
        postfix["val"] = f"{last_validation:.3f}"
    postfix["gnorm"] = fmt("trainer/grad_norm", ".3g")
    postfix["tok_s"] = fmt("perf/tokens_per_second", ".0f")
    return postfix
