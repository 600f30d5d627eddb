"""Every `scripts/bench_*.py --smoke` runs in the test environment (CPU, no optional packages):
it exits 0, prints its table, and each row that needs a missing optional package says so."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("transformers", "liger_kernel", "cut_cross_entropy", "vllm")
"""Packages some benchmark rows need and the test environment does not install."""
SLOW = {
    "bench_weight_sync.py",
    "bench_async.py",
    "bench_failover.py",
    "bench_sync_death.py",
    "bench_lora.py",
    "bench_vllm_lora.py",
    "bench_routing.py",
    "bench_worker_stop.py",
}
"""Smokes over ~20 s on a 2-core CPU (Monarch spawns two processes that import the model)."""
BENCHES = sorted(p.name for p in (ROOT / "scripts").glob("bench_*.py"))


def optional_imports(script: str) -> list[str]:
    """The optional packages the script imports (`import x` / `from x[.y] import ...`)."""
    source = (ROOT / "scripts" / script).read_text()
    return [p for p in OPTIONAL if re.search(rf"^\s*(from|import)\s+{p}\b", source, re.M)]


def test_benches_found():
    assert {"bench_generate.py", "bench_logprob.py", "bench_train.py"} <= set(BENCHES)
    # the pattern finds the optional rows' imports (and not liger_kernel.transformers)
    assert "transformers" in optional_imports("bench_generate.py")
    assert {"liger_kernel", "cut_cross_entropy"} <= set(optional_imports("bench_logprob.py"))
    assert "transformers" not in optional_imports("bench_logprob.py")


@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in BENCHES]
)
def test_bench_smoke_runs(script, tmp_path):
    env = {
        **os.environ,
        "OUT": str(tmp_path),  # where the scripts write their JSON
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    run = subprocess.run(
        [sys.executable, f"scripts/{script}", "--smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert "|" in run.stdout, output[-4000:]  # printed its table
    for package in optional_imports(script):
        if importlib.util.find_spec(package) is None:
            assert f"{package} is not installed" in run.stdout, output[-4000:]


MONARCH = re.compile(r"^\s*from monarch\.actor import|import Controller\b", re.M)


def test_scripts_that_start_monarch_exit_through_leave():
    """Monarch's exit hook shuts the client mesh down again and, on a loaded host, prints a
    `TimeoutError` traceback after the table (CI, bench_failover's smoke); `train.leave`
    flushes and skips it, as `train.py` does."""
    scripts = [p for p in sorted((ROOT / "scripts").glob("*.py")) if MONARCH.search(p.read_text())]
    assert {"bench_failover.py", "bench_weight_sync.py"} <= {p.name for p in scripts}
    for path in scripts:
        main_block = path.read_text().split('if __name__ == "__main__":')[-1]
        assert "leave(" in main_block, f"{path.name} exits through Monarch's exit hook"
