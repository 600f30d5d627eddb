"""A run folder stays whole: one live run per folder, SIGTERM is a stop that resumes, and a
damaged newest checkpoint is set aside for the newest whole one."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtitan_rl.controller.checkpoints import CheckpointStore, ControllerState
from torchtitan_rl.controller.resume import check_resume
from torchtitan_rl.controller.run_lock import RunFolderBusy, RunLock

ROOT = Path(__file__).resolve().parents[1]
FAST = (
    "--warm_start.steps=2",
    "--warm_start.batch_size=4",
    "--rollout.group_size=2",
    "--rollout.prompts_per_step=2",
    "--rollout.max_tokens=16",
    "--validation.max_tokens=16",
    "--rollout.filter_zero_std_groups=false",
    "--validation.interval=0",
    "--generator.max_num_seqs=8",
    "--checkpoint.interval=2",
)


ONE_TRAINER = ("--parallelism.trainer_procs=1",)
"""For the runs whose checks need no second trainer rank (a process fewer to start): the
SIGTERM test keeps the default 2, every process of a sharded trainer must close."""


def _command(tmp_path, *overrides):
    return [
        sys.executable, "-m", "torchtitan_rl.train", f"--job.output_dir={tmp_path}",
        "--job.run_name=run", *FAST, *overrides,
    ]  # fmt: skip


def _start(tmp_path, *overrides):
    """The CLI in a session of its own, so every process it leaves can be found."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        _command(tmp_path, *overrides), cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait_for(path: Path, proc, timeout=240.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and (path.is_dir() or path.stat().st_size)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def _session_processes(sid: int) -> list[int]:
    """Live processes (not zombies) of session `sid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


# ---- the lock -------------------------------------------------------------------------------
@pytest.mark.usefixtures("package_logger_restored")
def test_a_second_lock_on_a_live_folder_names_the_folder_and_the_holder(tmp_path, caplog):
    first, second = RunLock(tmp_path / "run"), RunLock(tmp_path / "run")
    first.acquire()
    with pytest.raises(RunFolderBusy, match=rf"{tmp_path / 'run'} is in use by another run "
                       rf"\(process {os.getpid()} on .*\); wait for it to end"):  # fmt: skip
        second.acquire()
    first.release()
    logging.getLogger("torchtitan_rl").propagate = True
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl"):
        second.acquire()  # released cleanly: nothing to take over
    assert "took over" not in caplog.text
    second.release()


@pytest.mark.usefixtures("package_logger_restored")
def test_a_lock_left_by_a_killed_run_is_taken_over_with_one_line(tmp_path, caplog):
    code = (
        "import sys, time; from torchtitan_rl.controller.run_lock import RunLock; "
        "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(RunFolderBusy, match=f"process {proc.pid} "):
        RunLock(tmp_path).acquire()
    proc.kill()
    proc.wait(timeout=30)
    logging.getLogger("torchtitan_rl").propagate = True
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl"):
        lock = RunLock(tmp_path)
        lock.acquire()
    assert f"the run that held it (process {proc.pid} on " in caplog.text
    assert "ended without releasing it" in caplog.text
    lock.release()


# ---- checkpoints that fail their manifest -------------------------------------------------
def _save(store: CheckpointStore, step: int) -> Path:
    tmp = store.begin(step)
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    state = ControllerState.capture(step=step, next_sample=8 * step, last_validation=0.0,
                                    history={})  # fmt: skip
    return store.commit(tmp, step, state, "")


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda f: _truncate(f / "controller.json"), "controller.json has"),
        (lambda f: _truncate(f / "trainer" / "__0_0.distcp"), "__0_0.distcp has"),
        (lambda f: _flip_byte(f / "trainer" / "__0_0.distcp"), "does not match its checksum"),
        (lambda f: (f / "trainer" / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    ],
)
def test_a_damaged_newest_checkpoint_gives_way_to_the_newest_whole_one(tmp_path, damage, named):
    store = CheckpointStore(tmp_path, keep_latest=2)
    _save(store, 2)
    newest = _save(store, 4)
    assert json.loads((newest / "MANIFEST.json").read_text())["controller.json"]["bytes"] > 0
    damage(newest)
    store = CheckpointStore(tmp_path, keep_latest=2)  # a fresh start reads it anew
    assert store.latest().name == "step_2"
    assert named in store.problem(newest) and str(newest) in store.problem(newest)
    (moved, problem), = store.set_aside_damaged()  # fmt: skip
    assert moved.name == "damaged-step_4" and named in problem
    assert [s for s, _ in store.complete()] == [2]
    _save(store, 4)  # the run goes on past it; pruning never touches the damaged copy
    _save(store, 6)
    assert [s for s, _ in store.complete()] == [4, 6]
    assert moved.is_dir()


def test_a_checkpoint_without_a_manifest_still_loads_when_its_json_reads(tmp_path):
    store = CheckpointStore(tmp_path, keep_latest=2)
    folder = _save(store, 2)
    (folder / "MANIFEST.json").unlink()  # written before manifests existed
    assert CheckpointStore(tmp_path, keep_latest=2).latest() == folder
    (folder / "controller.json").write_text('{"step": 2, "next_')
    assert CheckpointStore(tmp_path, keep_latest=2).latest() is None


def test_no_whole_checkpoint_refuses_to_start_over_silently(tmp_path):
    from test_first_hour import TINY

    from torchtitan_rl.config import load_config

    config = load_config(TINY, [f"--job.output_dir={tmp_path}", "--job.run_name=run"])
    store = CheckpointStore(tmp_path / "run", keep_latest=2)
    _truncate(_save(store, 2) / "controller.json")
    with pytest.raises(ValueError, match=r"no checkpoint in .* is whole \(the newest: .*"
                       r"controller.json has .*\); move .* away"):  # fmt: skip
        check_resume(CheckpointStore(tmp_path / "run", keep_latest=2), config)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ---- through the command line ----------------------------------------------------------
@pytest.mark.slow
def test_a_second_run_into_a_live_folder_stops_and_the_first_keeps_its_checkpoints(tmp_path):
    first = _start(tmp_path, "--training.steps=6", *ONE_TRAINER)
    _wait_for(tmp_path / "run" / "run.lock", first)
    second = subprocess.run(
        _command(tmp_path, "--training.steps=6", *ONE_TRAINER), cwd=ROOT,
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120,
    )  # fmt: skip
    assert second.returncode == 1, second.stderr
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, second.stderr
    assert lines[0].startswith(
        f"error: {tmp_path / 'run'} is in use by another run (process {first.pid} on "
    ), second.stderr
    assert lines[0].endswith("wait for it to end, or pick another job.run_name")
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    store = CheckpointStore(tmp_path / "run", keep_latest=2)
    assert [s for s, _ in store.complete()] == [4, 6]
    assert all(store.problem(path) is None for _, path in store.complete())

    # a truncated trainer shard in the newest: the next run continues from the one before
    shard = next((store.root / "step_6" / "trainer").glob("*.distcp"))
    _truncate(shard)
    more = subprocess.run(
        _command(tmp_path, "--training.steps=8", *ONE_TRAINER), cwd=ROOT,
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600,
    )  # fmt: skip
    assert more.returncode == 0, more.stderr
    assert f"checkpoint damaged: {shard} has " in more.stderr
    assert "moved it to " + str(store.root / "damaged-step_6") in more.stderr
    assert "after RL step 4" in more.stderr
    assert [s for s, _ in CheckpointStore(tmp_path / "run", 2).complete()] == [6, 8]


@pytest.mark.slow
def test_sigterm_is_a_stop_that_closes_every_process_and_resumes(tmp_path):
    proc = _start(tmp_path, "--training.steps=40")
    _wait_for(tmp_path / "run" / "checkpoints" / "step_2" / "COMPLETE", proc)
    time.sleep(1.0)  # into a later step
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("terminated (SIGTERM): the same command resumes after RL step "), err
    deadline = time.monotonic() + 30
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _session_processes(proc.pid) == [], "processes left behind"
    step = int(last.rsplit("after RL step ", 1)[1].split(" ")[0])
    again = subprocess.run(
        _command(tmp_path, f"--training.steps={step + 2}"), cwd=ROOT, capture_output=True,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert f"resuming {tmp_path / 'run'} after RL step {step}" in again.stderr
    assert "took over" not in again.stderr  # the stopped run released its lock


SLOW_MESH_SHUTDOWN = """
import runpy, sys
from monarch._src.actor import actor_mesh

real_shutdown = actor_mesh.shutdown_context

def shutdown_that_times_out(host_timeout=None):  # a loaded machine: it takes past its second
    real_shutdown(host_timeout=host_timeout)
    raise TimeoutError("the client mesh did not shut down in time")

actor_mesh.shutdown_context = shutdown_that_times_out
sys.argv[0] = "torchtitan_rl.train"
runpy.run_module("torchtitan_rl.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_sigterm_exits_143_with_one_line_when_the_mesh_shuts_down_slowly(tmp_path):
    """Monarch's exit hook shuts the client mesh down once more after the run closed; when
    that times out, the exit code and the last line are still the run's own."""
    command = [sys.executable, "-c", SLOW_MESH_SHUTDOWN, *_command(tmp_path)[3:]]
    command += ["--training.steps=40", *ONE_TRAINER]
    proc = subprocess.Popen(
        command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait_for(tmp_path / "run" / "checkpoints" / "step_2" / "COMPLETE", proc)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "TimeoutError" not in err, err
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("terminated (SIGTERM): the same command resumes after RL step "), err
