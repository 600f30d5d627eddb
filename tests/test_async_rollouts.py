"""Rollouts generated ahead of training (rollout.max_staleness >= 1): the prompt ledger, the
staleness bound, the pipeline's schedule under forced interleavings, and, through Monarch,
the bound on every trained token, exact replay and a resume that loses no prompt."""

import asyncio

import numpy as np
import pytest

from torchtitan_rl.controller.ahead import BatchTimeout, RolloutPipeline
from torchtitan_rl.rollout.ledger import PromptLedger
from torchtitan_rl.rollout.rollouter import CollectedBatch
from torchtitan_rl.rollout.staleness import split_stale, staleness_metrics
from torchtitan_rl.types import (
    Completion,
    FinishReason,
    Rollout,
    RolloutGroup,
    RolloutStatus,
    RolloutTurn,
)


# ---- the ledger -------------------------------------------------------------------------
def test_the_ledger_hands_out_requeued_prompts_first_in_order():
    ledger = PromptLedger()
    assert ledger.draw(1, 3) == [0, 1, 2]
    assert ledger.draw(2, 2) == [3, 4]
    ledger.requeue([4, 1])
    assert ledger.draw(3, 3) == [1, 4, 5]
    assert ledger.settle(3) == [1, 4, 5] and ledger.settle(3) == []


def test_a_checkpoint_hands_out_again_what_was_in_flight_but_not_what_it_keeps():
    ledger = PromptLedger()
    ledger.draw(1, 2)  # trained
    ledger.settle(1)
    ledger.draw(2, 2)  # generated ahead, kept whole by the checkpoint
    ledger.draw(3, 2)  # in flight
    ledger.draw(3, 1)  # ... its refill round
    assert ledger.saved(keep={2}) == (7, [4, 5, 6])
    resumed = PromptLedger(next_fresh=7, requeued=[4, 5, 6])
    assert resumed.draw(3, 2) == [4, 5] and resumed.draw(3, 2) == [6, 7]


# ---- the staleness bound ----------------------------------------------------------------
def _rollout(*versions: tuple[int, int], tokens=3, status=RolloutStatus.COMPLETED) -> Rollout:
    rollout = Rollout(group_id=0, rollout_id=0, session_id="s", sample={}, status=status)
    for low, high in versions:
        completion = Completion(
            request_id="r", token_ids_N=np.zeros(tokens, np.int32),
            logprobs_N=np.zeros(tokens, np.float32), finish_reason=FinishReason.STOP,
            policy_version_min=low, policy_version_max=high,
        )  # fmt: skip
        rollout.turns.append(
            RolloutTurn(
                prompt_ids=np.zeros(1, np.int32),
                completion=completion,
                assistant_text="",
                env_messages=[],
                reward_signals={},
            )  # fmt: skip
        )
    return rollout


def _group(*rollouts, index=0) -> RolloutGroup:
    return RolloutGroup(group_id=index, rollouts=list(rollouts), sample_index=index)


def test_a_group_with_one_token_past_the_bound_is_dropped_whole():
    fresh = _group(_rollout((4, 5)), _rollout((5, 5), (5, 6)), index=0)
    mixed = _group(_rollout((5, 5)), _rollout((5, 5), (3, 5)), index=1)  # turn 2 from v3
    at_bound = _group(_rollout((4, 4)), index=2)
    kept, stale = split_stale([fresh, mixed, at_bound], version=5, max_staleness=1)
    assert kept == [fresh, at_bound] and stale == [mixed]
    kept, stale = split_stale([fresh, mixed, at_bound], version=5, max_staleness=0)
    assert kept == [] and stale == [fresh, mixed, at_bound]


def test_staleness_is_counted_per_generated_token():
    groups = [
        _group(_rollout((4, 4), tokens=3), _rollout((5, 5), tokens=1)),
        _group(_rollout((2, 2), tokens=5, status=RolloutStatus.ERROR_REWARD)),  # not trained
    ]
    metrics = staleness_metrics(groups, version=5)
    assert metrics == {"rollout/staleness/mean": 0.75, "rollout/staleness/max": 1.0}


class _Lagging:
    """A replica answering at policy version `version`; `dies_at`: its call number that
    finds its process dead (ReplicaDown), as do all later ones."""

    def __init__(self, version, dies_at=None):
        self.version, self.dies_at, self.calls = version, dies_at, []

    async def __call__(self, prompt_ids, *, request_id, session_id=None, sampling=None):
        from fakes import IM_END, encode, make_completion

        from torchtitan_rl.rollout.router import ReplicaDown

        self.calls.append(session_id)
        if self.dies_at is not None and len(self.calls) >= self.dies_at:
            raise ReplicaDown("replica")
        ids = [*encode("ok"), IM_END]
        return make_completion(ids, request_id=request_id, policy_version=self.version)


def test_a_turn_rerouted_through_a_death_cannot_carry_its_rollout_past_the_bound():
    """A 2-turn rollout's first turn is sampled at v3 by a replica that dies before its
    second; the second is moved to a replica at v5. The rollout keeps both turns with their
    own versions, so under rollout.max_staleness = 1 its group is dropped when v5 is updated
    (the reroute does not relabel the v3 tokens), and kept under 2."""
    from fakes import FakeEnvironment, FakeRenderer, ScriptedEnv, done, reply

    from torchtitan_rl.envs.base import EnvConfig
    from torchtitan_rl.rollout.rollout_config import RolloutConfig
    from torchtitan_rl.rollout.rollouter import Rollouter
    from torchtitan_rl.rollout.router import Router

    env_config = EnvConfig(max_rollout_tokens=1000, max_turns=5)
    config = RolloutConfig(
        group_size=2, prompts_per_step=1, max_staleness=1, filter_zero_std_groups=False
    )

    def make_env(sample):
        return ScriptedEnv([reply("more"), done()])

    environment = FakeEnvironment(make_env, lambda r: 1.0, config=env_config)
    rollouter = Rollouter(environment, FakeRenderer(), env_config, config, seed=0)
    lagging, current = _Lagging(3, dies_at=2), _Lagging(5)
    router = Router([lagging, current])

    batch = asyncio.run(rollouter.collect_batch(1, 0, router))
    (group,) = batch.groups
    turn_versions = [[t.completion.policy_version_min for t in r.turns] for r in group.rollouts]
    assert sorted(turn_versions) == [[3, 5], [5, 5]]
    assert router.rerouted == 1 and router.down == {0}
    kept, stale = split_stale([group], version=5, max_staleness=config.max_staleness)
    assert kept == [] and stale == [group]
    kept, stale = split_stale([group], version=5, max_staleness=2)
    assert kept == [group] and stale == []


# ---- the pipeline, under forced interleavings ----------------------------------------------
class _Scripted:
    """collect(step) that finishes only when the test says so; logs start and end."""

    def __init__(self):
        self.events, self.release = [], {}

    async def __call__(self, step):
        self.events.append(("start", step))
        self.release.setdefault(step, asyncio.Event())
        await self.release[step].wait()
        self.events.append(("end", step))
        return CollectedBatch(groups=[], next_index=0, rounds=1, filtered=[])

    def finish(self, step):
        self.release.setdefault(step, asyncio.Event()).set()


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_pipelined_batches_run_one_after_another_and_streaming_ones_overlap():
    async def go(sequential):
        collect = _Scripted()
        pipeline = RolloutPipeline(collect, sequential=sequential)
        pipeline.fill(3)
        await _settle()
        started = list(collect.events)
        collect.finish(2)
        collect.finish(1)
        await _settle()
        collect.finish(3)
        await pipeline.take(3, 5.0, None)
        await pipeline.close()
        return started, collect.events

    started, events = asyncio.run(go(sequential=True))
    assert started == [("start", 1)]  # 2 waits for 1 even though it was released first
    assert events == [("start", 1), ("end", 1), ("start", 2), ("end", 2), ("start", 3), ("end", 3)]
    started, events = asyncio.run(go(sequential=False))
    assert started == [("start", 1), ("start", 2), ("start", 3)]
    assert events[3:] == [("end", 2), ("end", 1), ("end", 3)]


def test_a_batch_that_never_comes_ends_the_wait_with_what_the_generators_do():
    async def go():
        collect = _Scripted()
        pipeline = RolloutPipeline(collect, sequential=True)
        pipeline.fill(1)

        async def describe():
            return "generator: 3 requests in flight"

        with pytest.raises(
            BatchTimeout,
            match=r"^no batch for RL step 1 after 0.05 s "
            r"\(rollout.batch_timeout_s\): generator: 3 requests in flight$",
        ):
            await pipeline.take(1, 0.05, describe)
        await pipeline.close()

    asyncio.run(go())


def test_finished_batches_are_what_a_checkpoint_keeps_and_idle_time_is_counted():
    async def go():
        collect = _Scripted()
        pipeline = RolloutPipeline(collect, sequential=True)
        pipeline.idle_seconds()
        pipeline.fill(2)
        collect.finish(1)
        await _settle()
        assert sorted(pipeline.finished()) == [1]  # 2 is in flight
        await asyncio.sleep(0.02)
        assert pipeline.idle_seconds() < 0.01  # batch 2 kept the generators busy
        collect.finish(2)
        await pipeline.wait_done(2, 5.0, None)
        await asyncio.sleep(0.05)
        assert pipeline.idle_seconds() >= 0.04
        restored = RolloutPipeline(collect, sequential=True)
        restored.restore(0, pipeline.finished())
        restored.fill(2)  # nothing left to start
        assert sorted(restored.done) == [1, 2] and restored.last_started == 2
        assert restored.tasks == {}
        resumed = RolloutPipeline(collect, sequential=True)
        resumed.restore(3, {})  # a synchronous run's checkpoint keeps no batch
        resumed.fill(4)
        assert sorted(resumed.tasks) == [4]  # steps 1-3 trained before the checkpoint
        await resumed.close()
        await pipeline.close()

    asyncio.run(go())


def test_a_resume_starts_again_a_batch_that_was_in_flight_between_kept_ones():
    """Streaming, two steps ahead: the checkpoint after step 3 kept batch 5 (done) while batch
    4 was still running; the resumed pipeline generates 4 again and serves 5 as kept."""

    async def go():
        collect = _Scripted()
        kept = CollectedBatch(groups=[], next_index=0, rounds=1, filtered=[])
        pipeline = RolloutPipeline(collect, sequential=False)
        pipeline.restore(3, {5: kept})
        pipeline.fill(6)
        await _settle()
        assert sorted(pipeline.tasks) == [4, 6] and collect.events == [("start", 4), ("start", 6)]
        collect.finish(4)
        assert (await pipeline.take(4, 5.0, None)).rounds == 1
        assert await pipeline.take(5, 5.0, None) is kept
        await pipeline.close()

    asyncio.run(go())


def test_waiting_for_a_batch_before_new_weights_go_out_is_bounded_too():
    async def go():
        collect = _Scripted()
        pipeline = RolloutPipeline(collect, sequential=True)
        pipeline.fill(2)

        async def describe():
            return "generator: 1 requests in flight"

        with pytest.raises(BatchTimeout, match=r"^no batch for RL step 2 after 0.05 s"):
            await pipeline.wait_done(2, 0.05, describe)
        await pipeline.close()

    asyncio.run(go())


# ---- pipelined resume replay with a stale group in a kept batch -----------------------------
def _loop_in_rl_step_order(start, last, steps, lag, ledger, pipeline, trained):
    """Controller._run and rl_step with the real pipeline, ledger and split_stale, pipelined
    and `lag` steps ahead; the trainer is one await. Returns the checkpoint after `last`:
    (kept batches, next_fresh, requeued)."""

    async def go():
        pipeline.fill(min(start + 1 + lag, steps))
        for step in range(start + 1, last + 1):
            batch = await pipeline.take(step, 5.0, None)
            fresh, stale = split_stale(batch.groups, version=step - 1, max_staleness=lag)
            ledger.settle(step)
            ledger.requeue([g.sample_index for g in stale])
            trained[step] = [g.sample_index for g in fresh]
            await asyncio.sleep(0)  # the trainer
            await pipeline.wait_done(step + lag, 5.0, None)
            if step < last:
                pipeline.fill(min(step + 1 + lag, steps))
        kept = pipeline.finished()
        await pipeline.close()
        return (kept, *ledger.saved(keep=set(kept)))

    return asyncio.run(go())


def _pipeline_with_a_stale_group_in_batch_3(ledger):
    async def collect(step):
        indices = ledger.draw(step, 2)
        for _ in range(10):  # generating: longer than the loop takes to requeue
            await asyncio.sleep(0)
        # batch 3's first group comes from a lagging replica at version -9: dropped as stale
        versions = [-9 if step == 3 and i == 0 else step - 1 for i in range(len(indices))]
        groups = [_group(_rollout((v, v)), index=k) for v, k in zip(versions, indices)]
        return CollectedBatch(groups=groups, next_index=0, rounds=1, filtered=[])

    return RolloutPipeline(collect, sequential=True)


@pytest.mark.parametrize(
    ("lag", "stop", "want"),
    [
        (1, 2, {1: [0, 1], 2: [2, 3], 3: [5], 4: [6, 7], 5: [4, 8]}),
        (2, 1, {1: [0, 1], 2: [2, 3], 3: [5], 4: [6, 7], 5: [8, 9], 6: [4, 10]}),
    ],
)
def test_a_pipelined_resume_whose_kept_batch_holds_a_stale_group_trains_as_a_straight_run(
    lag, stop, want
):
    """Stopped after step `stop`, the checkpoint keeps batch 3, which holds a stale group. Its
    prompt goes out again after the batch started next drew its prompts, in the resumed run as
    in the straight one: taking a kept batch yields to the batch just started, as taking a
    finished one does (before, the resumed run handed prompt 4 to the step after batch 3)."""
    steps = max(want)
    ledger, straight = PromptLedger(), {}
    pipeline = _pipeline_with_a_stale_group_in_batch_3(ledger)
    _loop_in_rl_step_order(0, steps, steps, lag, ledger, pipeline, straight)
    assert straight == want

    ledger, resumed = PromptLedger(), {}
    pipeline = _pipeline_with_a_stale_group_in_batch_3(ledger)
    kept, next_fresh, requeued = _loop_in_rl_step_order(0, stop, steps, lag, ledger, pipeline, {})
    assert sorted(kept) == list(range(stop + 1, stop + 1 + lag)) and 3 in kept
    ledger = PromptLedger(next_fresh=next_fresh, requeued=requeued)
    pipeline = _pipeline_with_a_stale_group_in_batch_3(ledger)
    pipeline.restore(stop, kept)
    _loop_in_rl_step_order(stop, steps, steps, lag, ledger, pipeline, resumed)
    assert resumed == {s: v for s, v in straight.items() if s > stop}
