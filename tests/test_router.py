"""Router: session affinity, least-loaded fallback, no lost calls."""

import asyncio

import numpy as np

from torchtitan_rl.rollout.router import Router
from torchtitan_rl.types import Completion, FinishReason


class Replica:
    def __init__(self, name, delay=0.01):
        self.name, self.delay, self.calls = name, delay, []

    async def __call__(self, prompt_ids, *, request_id, session_id=None, sampling=None):
        self.calls.append((session_id, request_id))
        await asyncio.sleep(self.delay)
        return Completion(
            request_id=request_id,
            token_ids_N=np.zeros(1, np.int32),
            logprobs_N=np.zeros(1, np.float32),
            finish_reason=FinishReason.STOP,
            metrics={"replica": float(self.name)},
        )


def test_turns_of_a_session_stick_to_one_replica():
    replicas = [Replica(0), Replica(1), Replica(2)]
    router = Router(replicas)

    async def rollout(session):
        seen = set()
        for turn in range(3):
            c = await router(
                np.zeros(3, np.int32), request_id=f"{session}/{turn}", session_id=session
            )
            seen.add(c.metrics["replica"])
        return seen

    async def main():
        return await asyncio.gather(*(rollout(f"s{i}") for i in range(9)))

    results = asyncio.run(main())
    assert all(len(seen) == 1 for seen in results)
    # 9 concurrent sessions over 3 replicas: least-loaded placement spreads them evenly
    assert sorted(len({c[0] for c in r.calls}) for r in replicas) == [3, 3, 3]


def test_calls_without_session_go_to_the_least_loaded_replica():
    slow, fast = Replica(0, delay=0.2), Replica(1, delay=0.0)
    router = Router([slow, fast])

    async def main():
        first = asyncio.create_task(router(np.zeros(1, np.int32), request_id="a"))
        await asyncio.sleep(0)  # "a" is in flight on replica 0
        second = await router(np.zeros(1, np.int32), request_id="b")
        return await first, second

    a, b = asyncio.run(main())
    assert a.metrics["replica"] == 0 and b.metrics["replica"] == 1
    assert router.inflight == [0, 0]


def test_inflight_count_recovers_when_a_replica_raises():
    class Broken(Replica):
        async def __call__(self, *args, **kwargs):
            raise RuntimeError("gone")

    router = Router([Broken(0)])
    try:
        asyncio.run(router(np.zeros(1, np.int32), request_id="x", session_id="s"))
    except RuntimeError:
        pass
    assert router.inflight == [0]
