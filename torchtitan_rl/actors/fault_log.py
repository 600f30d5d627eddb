"""Last words of a process killed by a fatal signal.

Monarch reports only "killed by signal 6" when an actor's process aborts (a C++ assertion,
a gloo error, ...). `enable_fault_log` points Python's faulthandler at
<run_dir>/logs/<actor>-rank<r>.log: on SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL it writes
every thread's Python stack there, and the controller's one-line error names the file
(`controller.supervision`). SIGKILL (the OOM killer) leaves it empty.
"""

from __future__ import annotations

import faulthandler
from pathlib import Path
from typing import TextIO


def fault_log_path(folder: str | Path, actor: str, rank: int) -> Path:
    return Path(folder) / f"{actor}-rank{rank}.log"


def enable_fault_log(folder: str | None, actor: str, rank: int) -> TextIO | None:
    """Returns the open file: keep a reference for the life of the process (faulthandler
    writes to it at death). None when `folder` is None."""
    if folder is None:
        return None
    path = fault_log_path(folder, actor, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    file = path.open("w")
    faulthandler.enable(file=file, all_threads=True)
    return file
