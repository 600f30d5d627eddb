"""rollout.ahead and rollout.batch_timeout_s set in a TOML job file (one that `extends` the
default) reach the RL step: a Controller is built from the file as the CLI builds it, with
stand-ins for its actors and a scripted batch collector, and one RL step runs with step 2's
batch stuck in flight. Each test fails if its key were ignored:

    pipelined: batch 2 starts only after batch 1 ends, and the step waits for batch 2 before
               new weights go out; that wait ends after batch_timeout_s (0.3 s, not 1800 s)
               with the one-line BatchTimeout.
    streaming: batches 1 and 2 run at once, and the weights go out while batch 2 is in
               flight.
"""

import asyncio
import logging

import numpy as np
import pytest
from fakes import make_completion

from torchtitan_rl.config import load_config
from torchtitan_rl.controller.ahead import BatchTimeout
from torchtitan_rl.controller.loop import Controller
from torchtitan_rl.controller.replica import Replica
from torchtitan_rl.rollout.rollouter import CollectedBatch
from torchtitan_rl.types import Rollout, RolloutGroup, RolloutTurn

GUARD_S = 30.0
"""Ends a test that would otherwise wait rollout.batch_timeout_s's default (1800 s)."""


def _controller(tmp_path, ahead: str) -> Controller:
    job = tmp_path / "async.toml"
    job.write_text(
        'extends = "alphabet_sort_tiny.toml"\n'
        "[rollout]\n"
        "max_staleness = 1\n"
        f'ahead = "{ahead}"\n'
        "batch_timeout_s = 0.3\n"
    )
    config = load_config(job, [f"--job.output_dir={tmp_path}"])
    assert config.training.minibatches == 1  # so max_staleness = 1 runs one step ahead
    return Controller(config, use_tqdm=False)


class _StuckGenerator:
    """The generate function as the fleet asks it what it does."""

    in_flight = {"0/0/0/0": 0.0}

    def activity(self) -> str:
        return "generator: 1 request in flight"


def _one_step(controller: Controller) -> tuple[list[str], BaseException | None]:
    """RL step 1 as `Controller._run` drives it, batch 2 never finishing; returns the events
    in order (start/end of each batch, train, sync) and what the step raised."""
    events: list[str] = []
    stuck = asyncio.Event()

    async def collect_batch(step, group_offset, generate_fn, *, draw, play_group=None):
        events.append(f"start {step}")
        await asyncio.sleep(0.01)  # room for another batch to start meanwhile
        if step == 2:
            await stuck.wait()
        events.append(f"end {step}")
        return CollectedBatch(groups=[], next_index=0, rounds=1, filtered=[])

    async def train(trainer, groups):
        events.append("train")
        return {"trainer/policy_version": 1}

    async def sync_weights():
        events.append("sync")
        return 0.0

    controller.rollouter.collect_batch = collect_batch
    controller.stage.train, controller.sync_weights = train, sync_weights
    stuck_fn = _StuckGenerator()
    controller.fleet.replicas = [Replica(index=0, name="generator", actor=None, fn=stuck_fn)]
    controller.reporter = type("Reporter", (), {"report": staticmethod(lambda report: {})})

    async def go():
        controller.pipeline.fill(1 + controller.lag)
        try:
            await asyncio.wait_for(controller.rl_step(1), GUARD_S)
        finally:
            await controller.pipeline.close()

    try:
        asyncio.run(go())
    except BatchTimeout as e:
        return events, e
    return events, None


def test_pipelined_from_a_job_file_runs_batches_in_turn_and_waits_batch_timeout_s(tmp_path):
    events, error = _one_step(_controller(tmp_path, "pipelined"))
    assert events == ["start 1", "end 1", "start 2", "train"]  # no sync: batch 2 never ended
    assert isinstance(error, BatchTimeout)
    assert str(error).startswith("no batch for RL step 2 after 0.3 s (rollout.batch_timeout_s)")
    assert "generator: 1 request in flight" in str(error)


def test_streaming_from_a_job_file_overlaps_batches_and_syncs_while_one_is_in_flight(tmp_path):
    events, error = _one_step(_controller(tmp_path, "streaming"))
    assert error is None
    assert events == ["start 1", "start 2", "end 1", "train", "sync"]


@pytest.mark.parametrize(("key", "value"), [("batch_timeout_s", "0"), ("ahead", '"eager"')])
def test_a_bad_value_in_the_job_file_is_refused_at_load(tmp_path, key, value):
    job = tmp_path / "bad.toml"
    job.write_text(f'extends = "alphabet_sort_tiny.toml"\n[rollout]\n{key} = {value}\n')
    with pytest.raises(ValueError, match=f"rollout.{key}"):
        load_config(job, [f"--job.output_dir={tmp_path}"])


@pytest.mark.usefixtures("package_logger_restored")
def test_a_step_whose_groups_were_all_dropped_as_stale_says_they_were_too_stale(tmp_path, caplog):
    """Step 1's batch came from policy v0 while the trainer is at v3 (max_staleness = 1): its
    groups had reward spread but are all dropped, and the line says that, not "no spread"."""
    controller = _controller(tmp_path, "pipelined")

    def group(index):
        rollouts = [
            Rollout(group_id=index, rollout_id=i, session_id=f"{index}-{i}", sample={})
            for i in range(2)
        ]
        for rollout in rollouts:
            rollout.turns.append(
                RolloutTurn(
                    prompt_ids=np.zeros(1, np.int32),
                    completion=make_completion([5, 6]),
                    assistant_text="",
                    env_messages=[],
                    reward_signals={},
                )  # fmt: skip
            )
        return RolloutGroup(group_id=index, rollouts=rollouts, sample_index=index)

    async def collect_batch(step, group_offset, generate_fn, *, draw, play_group=None):
        return CollectedBatch(groups=[group(0), group(1)], next_index=2, rounds=1, filtered=[])

    async def train(trainer, groups):
        assert groups == []  # every group was dropped before packing
        return {}

    async def sync_weights():
        return 0.0

    controller.rollouter.collect_batch = collect_batch
    controller.stage.train, controller.sync_weights = train, sync_weights
    controller.reporter = type("Reporter", (), {"report": staticmethod(lambda report: {})})
    controller.trainer_version = 3

    async def go():
        controller.pipeline.fill(1 + controller.lag)
        try:
            await asyncio.wait_for(controller.rl_step(1), GUARD_S)
        finally:
            await controller.pipeline.close()

    logging.getLogger("torchtitan_rl").propagate = True
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl"):
        asyncio.run(go())
    assert "step 1: nothing to train on (all 2 groups were too stale: " in caplog.text
    assert "rollout/dropped_stale = 4 rollouts" in caplog.text
    assert "rollout.max_staleness=1" in caplog.text
    assert "reward spread" not in caplog.text
