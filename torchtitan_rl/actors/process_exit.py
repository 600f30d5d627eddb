"""A worker process that Monarch stopped exits at once.

When its proc mesh stops, Monarch's loop in the worker returns and the interpreter
finalizes: Monarch's runtime shutdown (up to 1 s), then the teardown of torch's and
torchtitan's modules. On the 2-core VM that made `ProcMesh.stop()` of a worker that imported
the generator take 4.18 s against 0.62 s (`scripts/bench_worker_stop.py`, docs/
benchmarks.md, "Stopping worker processes"), for work nobody needs: a worker's files are
closed by its actor's endpoints before the stop. `exit_at_stop` registers an exit hook that
runs before every hook registered earlier (exit hooks run last-registered first: Monarch's
and those of the modules imported before the actor started). It flushes the standard
streams and the logging handlers, terminates the process's multiprocessing children (as
multiprocessing's own exit hook would), and ends the process with `os._exit`, with the
exit code the process was leaving with: the one given to `sys.exit` (Monarch's worker ends
with `sys.exit(code)`, 1 when its actor failed; `exit_at_stop` wraps `sys.exit` to remember
it), 1 after an uncaught exception (the interpreter sets `sys.last_value` when it prints
one), else 0.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

_registered = False
_exit_code: list = []
"""The argument of the last `sys.exit` call, once there was one."""


def _remembering(exit):
    def remembering_exit(code=None):
        _exit_code[:] = [code]
        exit(code)

    return remembering_exit


def _leaving_code() -> int:
    if getattr(sys, "last_value", None) is not None:
        return 1
    if not _exit_code or _exit_code[0] is None:
        return 0
    return _exit_code[0] if isinstance(_exit_code[0], int) else 1  # as the interpreter does


def flush_output() -> None:
    """The standard streams and every logging handler, before an `os._exit`."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a reader that left; a stream already closed
            pass
    logging.shutdown()


def _exit_now() -> None:
    flush_output()
    if "multiprocessing" in sys.modules:
        children = sys.modules["multiprocessing"].active_children()
        for child in children:
            child.terminate()
        for child in children:
            child.join(timeout=1.0)
    os._exit(_leaving_code())


def exit_at_stop() -> None:
    """Once per process: at exit, skip the interpreter's finalization (module docstring)."""
    global _registered
    if not _registered:
        sys.exit = _remembering(sys.exit)
        atexit.register(_exit_now)
        _registered = True
