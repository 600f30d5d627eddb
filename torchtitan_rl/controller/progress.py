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
