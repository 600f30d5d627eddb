"""Every benchmark's --smoke runs in the test environment (no GPU, no optional packages):
rows that need a missing package say so and the script goes on."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted(p.name for p in (ROOT / "scripts").glob("bench_*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHES)
def test_bench_smoke_runs(script, tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--smoke"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OUT": str(tmp_path)},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "|" in run.stdout  # printed its table
    if script == "bench_generate.py" and importlib.util.find_spec("transformers") is None:
        assert "skipped (transformers is not installed)" in run.stdout
