"""Checkpoints on disk: an atomic folder per saved step, and the controller's own state.

    <run_dir>/checkpoints/
      step_6/                    complete: renamed into place after everything was written
        trainer/                 torch.distributed.checkpoint folder (every trainer rank)
        hf/                      Hugging Face export (only with checkpoint.export_hf)
        controller.json          ControllerState: step, data position, RNG, summary series
        config.toml              the resolved config that wrote it (for reference)
        COMPLETE                 the completion marker, written last
      .tmp-step_9/               a save in progress (or one killed mid-way): never loaded

A checkpoint is loaded only when its folder is named step_<N> and holds the marker, so a
process killed at any point of a save leaves the previous checkpoint as the latest.
No torch here: the controller process only moves folders and JSON.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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
        last_validation: float,
        history: dict[str, list[tuple[int, float]]],
    ) -> ControllerState:
        np_state = dict(np.random.get_state(legacy=False))
        np_state["state"] = {k: _jsonable(v) for k, v in np_state["state"].items()}
        return cls(
            step=step,
            next_sample=next_sample,
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
        done = self.complete()
        return done[-1][1] if done else None

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
        _fsync_tree(tmp)
        marker = tmp / MARKER
        marker.write_text(f"step {step}\n")
        _fsync_file(marker)
        final = self.root / f"step_{step}"
        if final.exists():  # an incomplete leftover of that name (complete ones are unique)
            shutil.rmtree(final)
        os.replace(tmp, final)
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
