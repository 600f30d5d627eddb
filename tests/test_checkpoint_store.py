"""Checkpoint folders: atomic commit, pruning, and a save killed with SIGKILL is never loaded."""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from torchtitan_rl.controller.checkpoints import MARKER, CheckpointStore, ControllerState

ROOT = Path(__file__).resolve().parents[1]


def _save(store: CheckpointStore, step: int) -> Path:
    tmp = store.begin(step)
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "shard").write_bytes(b"x" * 10)
    state = ControllerState.capture(
        step=step, next_sample=step * 8, last_validation=0.5, history={}
    )
    return store.commit(tmp, step, state, "[job]\n")


def test_commit_renames_into_place_and_keeps_the_latest(tmp_path):
    store = CheckpointStore(tmp_path, keep_latest=2)
    assert store.latest() is None
    for step in (2, 4, 6):
        folder = _save(store, step)
        assert folder.name == f"step_{step}" and (folder / MARKER).is_file()
    assert [s for s, _ in store.complete()] == [4, 6]
    assert store.load_state(store.latest()).next_sample == 48
    assert not list(store.root.glob(".tmp-*"))


def test_incomplete_folders_are_never_loaded(tmp_path):
    store = CheckpointStore(tmp_path, keep_latest=3)
    _save(store, 2)
    store.begin(4)  # a save in progress, or killed mid-way
    (store.root / "step_6").mkdir()  # a folder of the right name without the marker
    assert store.latest().name == "step_2"
    store.clean_temp()
    assert not (store.root / ".tmp-step_4").exists()
    _save(store, 8)
    assert not (store.root / "step_6").exists(), "pruned with the old ones"


KILLED_SAVE = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from torchtitan_rl.controller.checkpoints import CheckpointStore, ControllerState

    store = CheckpointStore(Path(sys.argv[1]), keep_latest=2)
    tmp = store.begin(4)
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "shard").write_bytes(b"y" * 1000)

    def stuck_rename(src, dst):  # the marker is written; die before the rename
        print("marker written", flush=True)
        time.sleep(60)

    os.replace = stuck_rename
    state = ControllerState.capture(step=4, next_sample=32, last_validation=0.0, history={})
    store.commit(tmp, 4, state, "")
    """
)


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path):
    store = CheckpointStore(tmp_path, keep_latest=2)
    _save(store, 2)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "marker written"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert (store.root / ".tmp-step_4" / MARKER).is_file(), "killed after the marker"
    latest = store.latest()
    assert latest.name == "step_2"
    state = store.load_state(latest)
    assert state.step == 2 and state.next_sample == 16
    assert json.loads((latest / "controller.json").read_text())["step"] == 2
