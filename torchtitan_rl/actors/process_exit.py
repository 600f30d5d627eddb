"""A worker process that Monarch stopped exits at once.

When its proc mesh stops, Monarch's loop in the worker returns and the interpreter
finalizes: Monarch's runtime shutdown (up to 1 s), then the teardown of torch's and
torchtitan's modules. On the 2-core VM that made `ProcMesh.stop()` of a worker that imported
the generator take 1.9-2.3 s against 0.54 s, and a two-step Monarch run 6-10 s longer (docs/
benchmarks.md, "Stopping worker processes"), for work nobody needs: a worker's files are
closed by its actor's endpoints before the stop. `exit_at_stop` registers an exit hook that
runs before every hook registered earlier (exit hooks run last-registered first: Monarch's
and those of the modules imported before the actor started). It flushes the standard
streams and the logging handlers, terminates the process's multiprocessing children (as
multiprocessing's own exit hook would), and ends the process with `os._exit`: exit code 1
after an uncaught exception (the interpreter sets `sys.last_value` when it prints one),
else 0.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

_registered = False


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a reader that left; a stream already closed
            pass
    logging.shutdown()
    if "multiprocessing" in sys.modules:
        children = sys.modules["multiprocessing"].active_children()
        for child in children:
            child.terminate()
        for child in children:
            child.join(timeout=1.0)
    os._exit(1 if getattr(sys, "last_value", None) is not None else 0)


def exit_at_stop() -> None:
    """Once per process: at exit, skip the interpreter's finalization (module docstring)."""
    global _registered
    if not _registered:
        atexit.register(_exit_now)
        _registered = True
