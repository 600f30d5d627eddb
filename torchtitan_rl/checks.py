"""Range checks for config values: one ValueError naming the key, the value and the range.

    check_range("training.lr", lr, gt=0)        -> "training.lr must be finite and > 0, got nan"
    check_range("loss.clip_low", c, ge=0, lt=1) -> "loss.clip_low must be in [0, 1), got 1.5"

NaN is never in range (every comparison with it is False, which is how NaN slips through a
plain `if x < 0` check); inf is out of range unless `allow_inf`.
"""

from __future__ import annotations

import math


def check_range(
    key: str,
    value: float,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    allow_inf: bool = False,
) -> None:
    """ValueError unless `value` is a number within the bounds given (ge: >=, gt: >, ...)."""
    ok = not math.isnan(value) and (allow_inf or math.isfinite(value))
    ok = ok and (ge is None or value >= ge) and (gt is None or value > gt)
    ok = ok and (le is None or value <= le) and (lt is None or value < lt)
    if not ok:
        raise ValueError(
            f"{key} must be {_describe(value, ge, gt, le, lt, allow_inf)}, got {value}"
        )


def _describe(value, ge, gt, le, lt, allow_inf) -> str:
    low, high = (ge if ge is not None else gt), (le if le is not None else lt)
    if low is not None and high is not None:
        text = f"in {'[' if ge is not None else '('}{low}, {high}{']' if le is not None else ')'}"
    elif low is not None:
        text = f">= {low}" if ge is not None else f"> {low}"
    elif high is not None:
        text = f"<= {high}" if le is not None else f"< {high}"
    else:
        text = "a number"
    if allow_inf:
        return f"{text} (inf allowed)"
    if isinstance(value, float) and (low is None or high is None):
        return f"finite and {text}" if text != "a number" else "a finite number"
    return text
