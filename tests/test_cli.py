"""The command line on a run folder that already finished (help and --print-config: see
tests/test_cli_help.py)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, cwd=ROOT):
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan_rl.train", *args],
        cwd=cwd, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    return out.returncode, out.stdout, out.stderr


def test_a_finished_run_says_so_without_starting_anything(tmp_path):
    from test_first_hour import _run_with_checkpoint

    _run_with_checkpoint(tmp_path, 7)
    rc, out, err = _run(f"--job.output_dir={tmp_path}", "--training.steps=7")
    assert rc == 0, err
    assert "already complete" in out and "RL step 7" in out
