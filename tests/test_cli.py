"""The command line a new user meets: help, the resolved config, a finished run, from any
folder; each answer is quick and names what to do."""

import subprocess
import sys
from pathlib import Path

import tomli

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, cwd=ROOT):
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan_rl.train", *args],
        cwd=cwd, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    return out.returncode, out.stdout, out.stderr


def test_help_lists_every_key_with_its_default_and_docstring():
    for flag in ("--help", "-h"):
        rc, out, err = _run(flag)
        assert rc == 0, err
        assert "usage: ./run_train.sh" in out
        assert "training.lr (float) = 0.0003" in out and "AdamW learning rate" in out
        assert "loss.old_logprobs (str)" in out and "[correction]" in out
        assert "env.args.reward_power (float) = 4.0" in out  # the environment's own settings


def test_the_default_config_is_found_from_any_folder(tmp_path):
    rc, out, err = _run("--print-config", "--env.args.sort_by=last", cwd=tmp_path)
    assert rc == 0, err
    config = tomli.loads(out)
    assert config["env"]["args"]["sort_by"] == "last" and config["training"]["steps"] == 500


def test_a_finished_run_says_so_without_starting_anything(tmp_path):
    from test_first_hour import _run_with_checkpoint

    _run_with_checkpoint(tmp_path, 7)
    rc, out, err = _run(f"--job.output_dir={tmp_path}", "--training.steps=7")
    assert rc == 0, err
    assert "already complete" in out and "RL step 7" in out
