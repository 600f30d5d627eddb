"""Runs a test module's check under the Triton interpreter, in a child process, and
splits a check in two processes.

Kept apart from fakes.py: the child imports the test module, and a test module that
imports only this (not torchtitan, through fakes) starts in a few seconds less."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path


def run_interpreted(test_module: str, fn: str = "check_interpreted", timeout: float = 300) -> None:
    """Runs `tests/<test_module>.py`'s `fn` in a child process with TRITON_INTERPRET=1 set
    before triton is first imported (the interpreter cannot run kernels whose
    triton.language was imported compiled); fails with the child's stderr."""
    tests_dir = Path(__file__).parent
    code = (
        "import sys, torch; torch.set_num_threads(1); sys.path.insert(0, sys.argv[1]); "
        f"import {test_module} as t; t.{fn}()"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(tests_dir.parent)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tests_dir)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def in_two_processes(first: Callable[[], None], second: Callable[[], None]) -> None:
    """Runs `first` in a forked copy of this process and `second` here, at once; fails if
    either fails (a failure in the copy prints its traceback to stderr). For the halves of
    a check that need only what both share: each is single-threaded, and CI has 2 cores."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            first()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    try:
        second()
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked half failed (traceback above)"
