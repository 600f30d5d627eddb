"""`--help`, `-h` and `--print-config`: what a new user reads before the first run. Help is
checked through `main` in this process (one torch import for all of it); the run from
another folder is a real subprocess, since the working directory is what it tests."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomli

from torchtitan_rl.config import Config
from torchtitan_rl.envs.alphabet_sort import AlphabetSortConfig
from torchtitan_rl.train import main

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("package_logger_restored")


def _main(monkeypatch, capsys, *args, config_file=None):
    """(exit code, stdout, stderr) of the entry point, with CONFIG_FILE set or unset."""
    if config_file is None:
        monkeypatch.delenv("CONFIG_FILE", raising=False)
    else:
        monkeypatch.setenv("CONFIG_FILE", config_file)
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_section_and_key(flag, monkeypatch, capsys):
    rc, out, _ = _main(monkeypatch, capsys, flag)
    assert rc == 0
    assert out.startswith("usage: ./run_train.sh")
    for text in ("CONFIG_FILE", "--section.key=value", "--env.args.key=value", "--debug"):
        assert text in out
    config = Config()
    for section in dataclasses.fields(config):
        assert f"[{section.name}]" in out
        for key in dataclasses.fields(getattr(config, section.name)):
            if key.name != "args":  # env.args is its own table, listed below
                assert f"  {section.name}.{key.name} (" in out


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_gives_type_default_and_docstring(flag, monkeypatch, capsys):
    rc, out, _ = _main(monkeypatch, capsys, flag)
    assert rc == 0
    lines = out.splitlines()
    at = lines.index("  training.lr (float) = 0.0004")
    assert lines[at + 1].strip() == "AdamW learning rate after warmup, finite and > 0."
    assert all(len(line) <= 100 for line in lines)  # long docstrings are wrapped


def test_help_lists_the_environments_own_settings(monkeypatch, capsys):
    rc, out, _ = _main(monkeypatch, capsys, "--help")
    assert rc == 0
    assert "[env.args]  (settings of environment 'alphabet_sort')" in out
    for key in dataclasses.fields(AlphabetSortConfig):
        assert f"  env.args.{key.name} (" in out
    assert 'env.args.sort_by (str) = "random"' in out and "Sort key:" in out


def test_help_shows_the_overrides_given(monkeypatch, capsys):
    rc, out, _ = _main(
        monkeypatch, capsys, "--help", "--training.lr=0.01", "--env.args.sort_by=last"
    )
    assert rc == 0
    assert "training.lr (float) = 0.01" in out and 'env.args.sort_by (str) = "last"' in out


def test_help_answers_when_the_job_does_not_load(monkeypatch, capsys, tmp_path):
    missing = str(tmp_path / "missing.toml")
    rc, out, err = _main(monkeypatch, capsys, "-h", "--training.nope=1", config_file=missing)
    assert rc == 0
    assert "training.lr (float) = 0.0003" in out and "env.args.sort_by (str)" in out
    assert "missing.toml" in err and "showing the defaults" in err


def test_print_config_from_another_folder_finds_the_default_config(tmp_path):
    """No CONFIG_FILE and a cwd outside the repository: the repository's default job."""
    env = {k: v for k, v in os.environ.items() if k != "CONFIG_FILE"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "-m", "torchtitan_rl.train", "--print-config"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    config = tomli.loads(run.stdout)
    assert config["job"]["run_name"] == "alphabet_sort_tiny"  # from the file, not defaults
    assert config["env"]["args"]["sort_by"] == "random"
    assert sorted(config["env"]["args"]) == sorted(
        f.name for f in dataclasses.fields(AlphabetSortConfig)
    )
    assert not (tmp_path / "outputs").exists()  # nothing ran


def test_print_config_applies_overrides_and_runs_nothing(monkeypatch, capsys, tmp_path):
    rc, out, _ = _main(
        monkeypatch,
        capsys,
        "--print-config",
        f"--job.output_dir={tmp_path}",
        "--env.args.max_names=3",
    )
    assert rc == 0
    config = tomli.loads(out)
    assert config["env"]["args"]["max_names"] == 3 and config["job"]["output_dir"] == str(tmp_path)
    assert list(tmp_path.iterdir()) == []
