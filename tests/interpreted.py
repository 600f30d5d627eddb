"""Runs a test module's check under the Triton interpreter, in a child process.

Kept apart from fakes.py: the child imports the test module, and a test module that
imports only this (not torchtitan, through fakes) starts in a few seconds less."""

from __future__ import annotations

import os
import subprocess
import sys
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
