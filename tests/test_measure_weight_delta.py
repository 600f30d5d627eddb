"""scripts/measure_weight_delta.py: counts changed bf16 words exactly, and runs a real job."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from measure_weight_delta import changed, per_tensor  # noqa: E402


def test_changed_counts_words_and_bytes():
    before = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    after = before.clone()
    after[1] = 2.015625  # the next bf16 after 2.0: only the low byte of its word differs
    after[3] = -4.0  # the sign: only the high byte
    c = changed(before, after)
    assert c["words_changed"] == 0.5 and c["changed_words"] == 2
    assert c["bytes_changed"] == 2 / 8
    layout = [("a", (2,), 0), ("tied", (2,), 0), ("b", (2,), 2)]
    assert per_tensor(before, after, layout) == [("a", 0.5), ("b", 0.5)]


@pytest.mark.slow
def test_the_script_measures_a_real_job(tmp_path):
    run = subprocess.run(
        [sys.executable, "scripts/measure_weight_delta.py", "--steps", "2",
         "--out", str(tmp_path), "--run-dir", str(tmp_path / "runs"),
         "--warm_start.steps=0", "--validation.interval=0", "--rollout.prompts_per_step=2",
         "--rollout.group_size=2", "--rollout.max_tokens=8", "--training.warmup_steps=0",
         "--rollout.filter_zero_std_groups=false", "--loss.entropy_coef=0.01"],  # a gradient
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "weight_delta.json").read_text())
    assert [r["step"] for r in result["steps"]] == [1, 2]
    assert all(0 < r["words_changed"] <= 1 for r in result["steps"])
    assert "bf16 words changed" in run.stdout
