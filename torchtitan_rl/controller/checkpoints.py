"""Checkpoints on disk: an atomic folder per saved step, and the controller's own state.

    <run_dir>/checkpoints/
      step_6/                    complete: renamed into place after everything was written
        trainer/                 torch.distributed.checkpoint folder (every trainer rank)
        hf/                      Hugging Face export (only with checkpoint.export_hf)
        controller.json          ControllerState: step, data position, RNG, summary series
        config.toml              the resolved config that wrote it (for reference)
        MANIFEST.json            {file: {"bytes": n, "sha256": hex}} of every file above
        COMPLETE                 the completion marker, written last
      .tmp-step_9/               a save in progress (or one killed mid-way): never loaded
      damaged-step_8/            a checkpoint that failed its manifest, moved aside, kept

A checkpoint is loaded only when its folder is named step_<N>, holds the marker and every file
matches the manifest, so a process killed at any point of a save leaves the previous checkpoint
as the latest, and so does a file damaged after the save (a full disk, a truncated copy): the
run then continues from the newest checkpoint that is whole and says which file was wrong.
No torch here: the controller process only moves folders and JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"
DAMAGED_PREFIX = "damaged-"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_HASH_CHUNK = 1 << 24


@dataclass(kw_only=True, slots=True)
class ControllerState:
    """What the controller needs to continue a run as if it never stopped.

    Request seeds derive from (seed, step, group, rollout, turn), so the step and the next
    dataset index fully determine the next rollouts; the global RNGs are kept for user
    envs that draw from them.
    """

    step: int
    """Last RL step whose optimizer update the checkpoint holds (also the TensorBoard step:
    metrics are logged at the RL step, the warm start at steps <= 0)."""
    next_sample: int
    """Index of the next unused training prompt (`Environment.train_sample(index)`)."""
    requeued: list[int] = field(default_factory=list)
    """Prompts handed out before the save whose batch was neither trained nor kept (still in
    flight, or dropped as stale): generated again first on resume."""
    last_validation: float = float("nan")
    """validation_reward/mean of the last evaluation (shown in the progress bar)."""
    python_rng: list = field(default_factory=list)
    """`random.getstate()` as JSON lists."""
    numpy_rng: dict = field(default_factory=dict)
    """`np.random.get_state(legacy=False)` with the key array as a list."""
    history: dict[str, list[list[float]]] = field(default_factory=dict)
    """Summary series so far: {tag: [[step, value], ...]} (TensorBoard keeps the rest)."""

    @classmethod
    def capture(
        cls,
        *,
        step: int,
        next_sample: int,
        requeued: list[int] = (),
        last_validation: float,
        history: dict[str, list[tuple[int, float]]],
    ) -> ControllerState:
        np_state = dict(np.random.get_state(legacy=False))
        np_state["state"] = {k: _jsonable(v) for k, v in np_state["state"].items()}
        return cls(
            step=step,
            next_sample=next_sample,
            requeued=list(requeued),
            last_validation=last_validation,
            python_rng=_jsonable(random.getstate()),
            numpy_rng=np_state,
            history={k: [[s, v] for s, v in series] for k, series in history.items()},
        )

    def restore_rngs(self) -> None:
        if self.python_rng:
            version, internal, gauss = self.python_rng
            random.setstate((version, tuple(internal), gauss))
        if self.numpy_rng:
            state = dict(self.numpy_rng)
            state["state"] = {
                k: np.asarray(v, dtype=np.uint32) if isinstance(v, list) else v
                for k, v in state["state"].items()
            }
            np.random.set_state(state)

    def to_json(self) -> str:
        return json.dumps(asdict(self), allow_nan=True)

    @classmethod
    def from_json(cls, text: str) -> ControllerState:
        return cls(**json.loads(text))


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    return value


class CheckpointStore:
    """Creates, completes, finds and prunes checkpoint folders under one run's folder."""

    def __init__(self, run_dir: Path, keep_latest: int):
        assert keep_latest >= 1
        self.root = Path(run_dir) / "checkpoints"
        self.keep_latest = keep_latest
        self._problems: dict[Path, str | None] = {}
        """`problem(folder)` answers, once per folder (hashing a big checkpoint takes seconds)."""

    def complete(self) -> list[tuple[int, Path]]:
        """(step, folder) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and (path / MARKER).is_file():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint whose files match its manifest (reads only)."""
        for _, path in reversed(self.complete()):
            if self.problem(path) is None:
                return path
        return None

    def problem(self, folder: Path) -> str | None:
        """What is wrong with a complete checkpoint's files (naming the file), or None."""
        if folder not in self._problems:
            self._problems[folder] = verify(folder)
        return self._problems[folder]

    def set_aside_damaged(self) -> list[tuple[Path, str]]:
        """Rename every complete checkpoint newer than `latest()` that fails its manifest to
        damaged-step_<N> (kept for a look, never loaded or pruned); returns (new path, what
        is wrong) for each. Call while holding the run's lock."""
        good = self.latest()
        newest_good = int(_STEP_DIR.match(good.name).group(1)) if good else -1
        moved = []
        for step, path in self.complete():
            problem = self.problem(path)
            if step > newest_good and problem is not None:
                target = path.with_name(DAMAGED_PREFIX + path.name)
                if target.exists():
                    shutil.rmtree(target)
                os.replace(path, target)
                self._problems.pop(path, None)
                moved.append((target, problem))
        return moved

    def begin(self, step: int) -> Path:
        """A fresh, empty temp folder for the checkpoint of `step` (a stale one is removed)."""
        tmp = self.root / f".tmp-step_{step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, step: int, state: ControllerState, config_toml: str) -> Path:
        """Write the controller's files and the marker into `tmp`, flush everything to disk,
        rename it to step_<step>, then drop checkpoints beyond `keep_latest`."""
        (tmp / "controller.json").write_text(state.to_json())
        (tmp / "config.toml").write_text(config_toml)
        (tmp / MANIFEST).write_text(json.dumps(_manifest(tmp), indent=1, sort_keys=True))
        _fsync_tree(tmp)
        marker = tmp / MARKER
        marker.write_text(f"step {step}\n")
        _fsync_file(marker)
        final = self.root / f"step_{step}"
        if final.exists():  # an incomplete leftover of that name (complete ones are unique)
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._problems.pop(final, None)
        _fsync_dir(self.root)
        self.prune()
        return final

    def prune(self) -> None:
        """Keep the newest `keep_latest` complete checkpoints; remove older ones and step_<N>
        folders without the marker."""
        keep = {path for _, path in self.complete()[-self.keep_latest :]}
        for path in self.root.iterdir() if self.root.is_dir() else []:
            if _STEP_DIR.match(path.name) and path not in keep:
                shutil.rmtree(path)

    def clean_temp(self) -> None:
        """Remove temp folders of saves that never completed (call before a run starts)."""
        for path in self.root.glob(".tmp-*") if self.root.is_dir() else []:
            shutil.rmtree(path)

    @staticmethod
    def load_state(folder: Path) -> ControllerState:
        assert (folder / MARKER).is_file(), f"{folder} is not a complete checkpoint"
        return ControllerState.from_json((folder / "controller.json").read_text())


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MARKER, MANIFEST))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest(folder: Path) -> dict[str, dict]:
    """{relative path: {"bytes": size, "sha256": hex}} of every file a checkpoint holds."""
    return {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files(folder)
    }


def verify(folder: Path) -> str | None:
    """None when every file of the checkpoint `folder` matches its manifest and its
    controller.json reads; else one phrase naming the file and what is wrong with it.
    A checkpoint written before manifests existed is checked by its controller.json only."""
    manifest_path = folder / MANIFEST
    if manifest_path.is_file():
        try:
            expected = json.loads(manifest_path.read_text())
        except ValueError:
            return f"{manifest_path} does not read as JSON"
        for name, entry in expected.items():
            path = folder / name
            if not path.is_file():
                return f"{path} is missing"
            size = path.stat().st_size
            if size != entry["bytes"]:
                return f"{path} has {size} bytes, the manifest says {entry['bytes']}"
            if _sha256(path) != entry["sha256"]:
                return f"{path} does not match its checksum"
    try:
        ControllerState.from_json((folder / "controller.json").read_text())
    except (OSError, ValueError, TypeError) as e:
        return f"{folder / 'controller.json'} does not read ({type(e).__name__}: {e})"
    return None


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    _fsync_file(path)  # a directory's entries are durable once its fd is fsync'ed


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))
