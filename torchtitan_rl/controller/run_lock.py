"""One run per folder: a run holds an exclusive lock on <run_dir>/run.lock while it lives.

A second run into the same folder stops before it touches anything:

    error: outputs/alphabet_sort_tiny is in use by another run (process 4711 on host-a,
    started 2026-11-26 12:40:02); wait for it to end, or pick another job.run_name

The lock is an `flock` on an open file, so the kernel drops it when the holding process dies,
however it dies. The file also records who held it; a run that finds a record but gets the
lock knows the previous holder ended without releasing it and says so in one line.
(`flock` is advisory and per host: two hosts sharing a network folder are not covered.)
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = "run.lock"


class RunFolderBusy(RuntimeError):
    """Another live run holds the folder; the message is the one line shown."""

    needs_no_traceback = True


class RunLock:
    """`acquire()` before the run writes anything into `run_dir`; `release()` at its end."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise RunFolderBusy naming the folder and the holder's process.
        Logs one line when it takes over a lock a dead run left behind."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise RunFolderBusy(
                f"{self.path.parent} is in use by another run ({holder or 'holder unknown'}); "
                "wait for it to end, or pick another job.run_name"
            ) from None
        left = _read(fd)
        if left:
            logger.warning("took over %s: the run that held it (%s) ended without releasing it",
                           self.path, left)  # fmt: skip
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}, started {started}\n"
                  .encode(), 0)  # fmt: skip
        self._fd = fd

    def release(self) -> None:
        """Clear the record (a clean end leaves nothing to take over) and drop the lock."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip()
