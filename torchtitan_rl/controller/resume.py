"""Saving a run's state and continuing from it: what changed since the checkpoint, the
restore, and the save (trainer shards, controller JSON, one atomic rename), held together
with the run's lock for the Controller by `RunFolder`.

The on-disk layout and the checks of a checkpoint's integrity live in `checkpoints`; this
module decides what goes into one and what a resume may change.
"""

from __future__ import annotations

import logging
import pickle
import shutil
from pathlib import Path

import tomli

from torchtitan_rl.config import Config, to_toml
from torchtitan_rl.controller.ahead import RolloutPipeline
from torchtitan_rl.controller.checkpoints import CheckpointStore, ControllerState
from torchtitan_rl.controller.run_lock import RunLock
from torchtitan_rl.controller.summary import SUMMARY_TAGS
from torchtitan_rl.rollout.ledger import PromptLedger
from torchtitan_rl.rollout.rollouter import CollectedBatch

PENDING = "pending_batches.pkl"
"""Batches generated ahead of the checkpoint's step (rollout.max_staleness >= 1); written and
read by this process only (it also wrote the manifest that vouches for them)."""
EARLIER_RUN = ("tb", "rollouts", "errors.log")
"""What a run that left no checkpoint leaves in its folder that would mix with a fresh run's:
TensorBoard events (TensorBoard would draw both runs as one curve), rollout records and
errors.log (both keyed by step)."""
RESUME_FROZEN = {
    "model.": "the checkpoint holds another model",
    **dict.fromkeys(
        ("lora.rank", "lora.alpha", "lora.target_modules"),
        "the checkpoint's adapters have another shape or scale, or the run trains other weights",
    ),
    "env.name": "the checkpoint's policy, prompt position and curves belong to another task",
}
"""Config keys (or key prefixes) a resume cannot change, each with why: the weights have that
model's shape (and the adapters theirs: lora.dropout, vllm_sync and generator_base may change,
they shape no weight); a policy trained on one environment would go on to train on another in the
same run and TensorBoard curves, its warm start skipped."""


logger = logging.getLogger(__name__)


def config_changes(saved: dict, config: Config) -> list[str]:
    """ "section.key: old -> new" for every key whose value differs from the saved TOML."""
    current = tomli.loads(to_toml(config))
    changes = []
    for section, values in current.items():
        for key, value in values.items():
            old = saved.get(section, {}).get(key)
            if isinstance(value, dict):  # [env.args]
                for sub, v in value.items():
                    if (old or {}).get(sub) != v:
                        changes.append(f"{section}.{key}.{sub}: {(old or {}).get(sub)!r} -> {v!r}")
            elif old != value:
                changes.append(f"{section}.{key}: {old!r} -> {value!r}")
    return changes


def check_resume(store: CheckpointStore, config: Config) -> list[str]:
    """Before anything is written or spawned: how `config` differs from the latest good
    checkpoint's (lines "key: old -> new"); ValueError for a change that cannot work."""
    latest = store.latest()
    if latest is None:
        complete = store.complete()
        if complete:  # there were checkpoints, and none is whole: never start over silently
            newest = complete[-1][1]
            raise ValueError(
                f"no checkpoint in {store.root} is whole (the newest: "
                f"{store.problem(newest)}); move {store.root.parent} away, or pick another "
                "job.run_name, to start over"
            )
        return []
    changes = config_changes(tomli.loads((latest / "config.toml").read_text()), config)
    for change in changes:
        key = change.split(":")[0]
        why = next((why for k, why in RESUME_FROZEN.items() if key.startswith(k)), None)
        if why is not None:
            raise ValueError(
                f"cannot resume {latest} with a changed {change}: {why}; use a new "
                f"job.run_name (or move {latest.parent.parent} away to start over)"
            )
    return changes


def open_run(
    store: CheckpointStore, config: Config, run_dir: Path
) -> tuple[Path | None, ControllerState | None]:
    """The run folder made ready (the run's lock held): damaged checkpoints set aside,
    temporary files cleaned, and an earlier run that left no checkpoint cleared; logs
    whether the run starts fresh or resumes (and what changed since). Returns the latest
    complete checkpoint and its state (None, None for a fresh run)."""
    changes = check_resume(store, config)
    for path, problem in store.set_aside_damaged():
        logger.warning("checkpoint damaged: %s; moved it to %s", problem, path)
    store.clean_temp()
    latest = store.latest()
    state = CheckpointStore.load_state(latest) if latest else None
    if state is None:
        cleared = clear_earlier_run(run_dir)
        said = f" (deleted {', '.join(cleared)} of an earlier run that left no checkpoint)"
        logger.warning("starting fresh in %s%s", run_dir, said if cleared else "")
        return None, None
    logger.warning("resuming %s after RL step %d (%s)", run_dir, state.step, latest)
    for change in changes:
        logger.warning("  changed since that checkpoint: %s", change)
    return latest, state


async def export_hf(trainer, config: Config, folder: Path) -> None:
    """The trainer's policy as a Hugging Face folder (checkpoint.export_dtype)."""
    await trainer.export_hf.call(
        str(folder), config.model.hf_checkpoint, config.checkpoint.export_dtype
    )


class RunFolder:
    """The run folder as the Controller holds it: one run at a time (its lock), the
    checkpoints it saves, and the one it continues from.

    folder = RunFolder(run_dir, config)
    folder.completed_step()                 # 4: step_4 is the latest complete one (0: none)
    latest, state = folder.open()           # the lock held; (None, None): a fresh run
    ledger = await folder.restore(trainer, latest, state, pipeline=..., history=...)
    await folder.save(trainer, 6, pipeline=..., ledger=..., last_validation=..., history=...)
    folder.release()                        # the lock, at the run's end
    """

    def __init__(self, run_dir: Path, config: Config):
        self.run_dir = run_dir
        self.config = config
        self.store = CheckpointStore(run_dir, config.checkpoint.keep_latest)
        self.lock = RunLock(run_dir)

    def completed_step(self) -> int:
        """The RL step of the latest complete checkpoint (0 without one); reads only."""
        latest = self.store.latest()
        return CheckpointStore.load_state(latest).step if latest else 0

    def check_resume(self) -> list[str]:
        """Before anything is written or spawned: how the config differs from the latest
        checkpoint's (`check_resume`); ValueError for a change that cannot work."""
        return check_resume(self.store, self.config)

    def open(self) -> tuple[Path | None, ControllerState | None]:
        """Take the folder's lock (before anything in it is read for use or written), then
        `open_run`: the latest complete checkpoint and its state."""
        self.lock.acquire()
        return open_run(self.store, self.config, self.run_dir)

    def release(self) -> None:
        """Let another run have the folder (safe before `open`)."""
        self.lock.release()

    async def restore(
        self, trainer, folder: Path, state: ControllerState, *, pipeline: RolloutPipeline,
        history: dict[str, list[tuple[int, float]]],
    ) -> PromptLedger:  # fmt: skip
        """Load the trainer's shards of `folder` on every rank and the global RNGs, give the
        batches it kept to `pipeline` and its summary series to `history`; returns the prompt
        ledger where it stopped (the caller takes `state.last_validation`)."""
        await trainer.load_checkpoint.call(str(folder / "trainer"))
        state.restore_rngs()
        pipeline.restore(state.step, load_pending(folder))
        for tag, series in state.history.items():
            history[tag] = [(int(s), float(v)) for s, v in series]
        return PromptLedger(next_fresh=state.next_sample, requeued=list(state.requeued))

    async def save(
        self, trainer, step: int, *, pipeline: RolloutPipeline, ledger: PromptLedger,
        last_validation: float, history: dict[str, list[tuple[int, float]]],
    ) -> Path:  # fmt: skip
        """Trainer ranks write their shards, `export_hf` the Hugging Face copy when the config
        asks for one; the batches generated ahead are kept whole, and the prompts of batches
        still in flight are handed out again on resume. The controller's JSON is captured
        last (it holds the RNG states after everything else); one rename makes it complete."""
        config, store = self.config, self.store
        pending = pipeline.finished()
        next_fresh, requeued = ledger.saved(keep=set(pending))
        tmp = store.begin(step)
        await trainer.save_checkpoint.call(str(tmp / "trainer"))
        if config.checkpoint.export_hf:
            await export_hf(trainer, config, tmp / "hf")
        if pending:
            (tmp / PENDING).write_bytes(pickle.dumps(pending, protocol=pickle.HIGHEST_PROTOCOL))
        state = ControllerState.capture(
            step=step, next_sample=next_fresh, requeued=requeued,
            last_validation=last_validation,
            history={t: history.get(t, []) for t in SUMMARY_TAGS},
        )  # fmt: skip
        return store.commit(tmp, step, state, to_toml(config))


def load_pending(folder: Path) -> dict[int, CollectedBatch]:
    """The batches a checkpoint kept whole: generated ahead by older weights, not trained."""
    path = folder / PENDING
    return pickle.loads(path.read_bytes()) if path.is_file() else {}


def clear_earlier_run(run_dir: Path) -> list[str]:
    """Before a fresh start: delete what an earlier run in `run_dir` left (it has no
    checkpoint, so nothing can continue it) and would mix with this run's; returns the
    names deleted, for the line that says so."""
    cleared = []
    for name in EARLIER_RUN:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        cleared.append(name + "/" if name != "errors.log" else name)
    return cleared
