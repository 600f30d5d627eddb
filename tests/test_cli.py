"""The command line on a run folder that already finished (help and --print-config: see
tests/test_cli_help.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_run_train_sh_reads_paths_and_modules_from_the_folder_it_is_called_in(
    tmp_path, monkeypatch
):
    """From a user's folder holding my_envs/ (docs/environments.md's files): CONFIG_FILE, the run
    folder and the environment module are all found there, not in the repository."""
    from test_env_plugin import guide_block

    from torchtitan_rl.config import load_config, to_toml
    from torchtitan_rl.controller.checkpoints import CheckpointStore, ControllerState

    (tmp_path / "my_envs").mkdir()
    (tmp_path / "my_envs" / "arith.py").write_text(guide_block("# my_envs/arith.py", "python"))
    (tmp_path / "my_envs" / "arith.toml").write_text(guide_block("# my_envs/arith.toml", "toml"))
    # a finished run in <tmp_path>/outputs/arith: the command answers without spawning
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config("my_envs/arith.toml")
    for name in ("my_envs.arith", "my_envs"):
        sys.modules.pop(name, None)
    last = config.training.steps
    store = CheckpointStore(tmp_path / "outputs" / "arith", keep_latest=2)
    state = ControllerState.capture(step=last, next_sample=0, last_validation=0.0, history={})
    store.commit(store.begin(last), last, state, to_toml(config))
    run = subprocess.run(
        ["bash", str(ROOT / "run_train.sh")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"CONFIG_FILE": "my_envs/arith.toml", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert f"already complete: outputs/arith holds the checkpoint of RL step {last}" in run.stdout
    assert not (ROOT / "outputs" / "arith").exists()


@pytest.mark.parametrize(
    "override, needle",
    [
        ("--generator.num_replicas=1000", "generator.num_replicas=1000: each generator replica "
         f"is a CPU process of its own, and this machine gives the run {len(os.sched_getaffinity(0))} "
         "CPU core(s)"),
        ("--parallelism.trainer_procs=1000", "parallelism.trainer_procs=1000: each trainer rank"),
        ("--job.output_dir=/etc/hostname", "job.output_dir='/etc/hostname' is a file; use a folder"),
        ("--job.output_dir=/etc/hostname/runs", "job.output_dir='/etc/hostname/runs' is under a "
         "file (/etc/hostname)"),
        ("--launcher.kind=slurm", "launcher.kind = \"slurm\" submits the job with Slurm's sbatch, "
         "which is not on PATH here"),
        ("--weight_sync.transport=cuda_ipc", 'weight_sync.transport = "cuda_ipc" needs trainer '
         "rank 0 and every generator on GPUs of one host, and this run is on CPU; valid here: "
         '"auto", "broadcast", "delta", "controller"'),
    ],
)  # fmt: skip
def test_what_this_machine_lacks_stops_before_anything_is_written(tmp_path, override, needle):
    """Values wrong only for this machine (cores, a file where the folder goes, no sbatch on
    PATH=/usr/bin:/bin, CUDA IPC without GPUs) exit 2 with one line saying what it has (no
    traceback); no run folder appears."""
    rc, out, err = _run(
        f"--job.output_dir={tmp_path / 'runs'}", override, "--parallelism.device=cpu", cwd=tmp_path
    )
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: ") and needle in lines[0] and "Traceback" not in out
    assert list(tmp_path.iterdir()) == []  # no run folder (nor outputs/ in the working folder)
