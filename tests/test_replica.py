"""ActorGenerateFn (controller/replica.py): a generate call on one replica's actor, answered,
failed, or given up when the replica is known dead."""

import asyncio
import gc

import numpy as np
import pytest
from fakes import MonarchLikeCall

from torchtitan_rl.actors.generate_fn import ActorGenerateFn
from torchtitan_rl.rollout.router import ReplicaDown


class Actor:
    """A generator actor whose calls are answered by hand: `calls[request_id]` is the
    future behind each call."""

    def __init__(self):
        self.calls: dict[str, asyncio.Future] = {}
        self.generate = self

    def call_one(self, prompt_ids, request_id, session_id, sampling):
        future = asyncio.get_running_loop().create_future()
        self.calls[request_id] = future
        return MonarchLikeCall(future)


def call(fn, request_id):
    return asyncio.ensure_future(fn(np.zeros(2, np.int32), request_id=request_id))


async def until(predicate):
    while not predicate():
        await asyncio.sleep(0)


@pytest.mark.parametrize("failover", [True, False])
def test_calls_waiting_on_a_replica_marked_gone_return_at_once(failover):
    actor = Actor()
    fn = ActorGenerateFn(actor, "generator1", failover=failover)

    async def main():
        waiting = [call(fn, f"r{i}") for i in range(3)]
        await until(lambda: len(actor.calls) == 3)
        actor.calls["r0"].set_result("answer")  # answered before the death: kept
        assert await waiting[0] == "answer"
        fn.fail_in_flight()
        outcomes = await asyncio.gather(*waiting[1:], return_exceptions=True)
        later = await asyncio.gather(call(fn, "r3"), return_exceptions=True)
        return outcomes + later

    outcomes = asyncio.run(main())
    if failover:  # the router sends them to another replica
        assert all(isinstance(o, ReplicaDown) and str(o) == "generator1" for o in outcomes)
    else:  # the Supervisor ends the run
        assert outcomes == [None, None, None]
    assert fn.in_flight == {} and fn.activity() == "generator1: down"
    assert "r3" not in actor.calls  # a replica known gone gets no more calls


@pytest.mark.parametrize("failover", [True, False])
def test_a_late_error_of_a_process_known_dead_counts_as_its_death(failover):
    actor = Actor()
    fn = ActorGenerateFn(actor, "generator1", failover=failover)

    async def main():
        waiting = call(fn, "r0")
        await until(lambda: "r0" in actor.calls)
        actor.calls["r0"].set_exception(ConnectionResetError("peer closed"))
        fn.fail_in_flight()  # before the caller resumed
        return (await asyncio.gather(waiting, return_exceptions=True))[0]

    outcome = asyncio.run(main())
    if failover:
        assert isinstance(outcome, ReplicaDown)
    else:
        assert outcome is None


def test_an_error_of_a_live_replica_fails_only_its_call(caplog):
    actor = Actor()
    fn = ActorGenerateFn(actor, "generator1", failover=True)

    async def main():
        failing, fine = call(fn, "r0"), call(fn, "r1")
        await until(lambda: len(actor.calls) == 2)
        actor.calls["r0"].set_exception(ValueError("bad request"))
        actor.calls["r1"].set_result("answer")
        return await failing, await fine

    assert asyncio.run(main()) == (None, "answer")  # r0 becomes a generator error
    assert "generate r0 failed: bad request" in caplog.text
    assert fn.activity() == "generator1: no request in flight"  # not down


def test_a_waiting_call_holds_no_task_of_its_own():
    """A call is its caller's task and the actor's own future: nothing per call for the
    death wait or around the actor's future, so 768 calls in flight cost the loop nothing
    while they wait."""
    actor = Actor()
    fn = ActorGenerateFn(actor, "generator1", failover=True)

    async def main():
        waiting = [call(fn, f"r{i}") for i in range(8)]
        await until(lambda: len(actor.calls) == 8)
        tasks = len(asyncio.all_tasks())
        for future in actor.calls.values():
            future.set_result("answer")
        await asyncio.gather(*waiting)
        return tasks

    assert asyncio.run(main()) == 1 + 8  # main and the 8 callers


def test_a_cancelled_caller_leaves_no_failure_logged_unread(caplog):
    """The run stops and cancels its rollouts; their calls fail later (the generator is
    stopped): nothing is logged as "exception was never retrieved"."""
    actor = Actor()
    fn = ActorGenerateFn(actor, "generator1", failover=True)

    async def main():
        waiting = call(fn, "r0")
        await until(lambda: "r0" in actor.calls)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        future = actor.calls.pop("r0")
        if not future.done():  # as Monarch does: it sets a future nobody cancelled
            future.set_exception(RuntimeError("the generator was stopped"))
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()  # an unread failure is logged when its future is freed
    assert "never retrieved" not in caplog.text
    assert fn.in_flight == {} and fn._waiting == set()
