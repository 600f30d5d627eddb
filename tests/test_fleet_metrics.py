"""The fleet's per-step report: how evenly calls were spread over the replicas, and what
each replica's engine did (busy share, weight pulls, steps, eager prefills) since the last
step, as deltas of the counters the generators keep since they started."""

import asyncio

import numpy as np
from test_failover import Replica as FakeGenerateFn
from test_failover import _fleet

from torchtitan_rl.controller.replica import Replica
from torchtitan_rl.rollout.router import Router


class _Endpoint:
    def __init__(self, answers):
        self.answers = answers

    async def call_one(self):
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


class _Actor:
    def __init__(self, *answers):
        self.engine_stats = _Endpoint(list(answers))


def _replicas(fleet, *actors):
    fleet.replicas = [
        Replica(index=i, name=f"generator{i}", actor=a, fn=None) for i, a in enumerate(actors)
    ]


def test_the_spread_of_calls_and_their_cost_is_reported_per_step(tmp_path):
    fleet, _ = _fleet(tmp_path)
    _replicas(fleet, _Actor(), _Actor())
    fleet.router = Router([FakeGenerateFn(0), FakeGenerateFn(1)])

    async def calls(n, tokens):
        await asyncio.gather(
            *(fleet.router(np.zeros(tokens, np.int32), request_id=f"r{i}") for i in range(n))
        )

    asyncio.run(calls(4, 3))  # least loaded: 2 calls each
    first = fleet.metrics()
    assert first["generator/routed_calls_max_over_mean"] == 1.0
    fleet.router.set_down(1)
    asyncio.run(calls(3, 5))  # all three to replica 0: max 3 over mean 1.5
    second = fleet.metrics()
    assert second["generator/routed_calls_max_over_mean"] == 2.0
    assert second["generator/routed_tokens_max_over_mean"] == 2.0
    assert "generator/routed_calls_max_over_mean" not in fleet.metrics()  # no call since


def test_engine_counters_are_reported_as_deltas_since_the_last_step(tmp_path):
    fleet, _ = _fleet(tmp_path)
    start = {"steps": 10, "drained_steps": 2, "eager_prefills": 1, "busy_s": 1.0, "pull_s": 0.1}
    later = {"steps": 30, "drained_steps": 3, "eager_prefills": 1, "busy_s": 1.5, "pull_s": 0.3}
    _replicas(fleet, _Actor(start, later), _Actor(start, RuntimeError("gone")))

    first = asyncio.run(fleet.engine_metrics())
    assert first["generator/engine_steps"] == 20  # both since they started
    assert "generator/engine_busy_fraction" not in first  # no interval yet
    second = asyncio.run(fleet.engine_metrics())  # the second replica fails to answer
    assert second["generator/engine_steps"] == 20
    assert second["generator/engine_drained_steps"] == 1
    assert second["generator/engine_eager_prefills"] == 0
    assert abs(second["generator/weight_pull_ms"] - 200.0) < 1e-6
    assert 0 < second["generator/engine_busy_fraction"]


def test_a_replica_that_is_down_is_not_asked(tmp_path):
    fleet, _ = _fleet(tmp_path)
    _replicas(fleet, _Actor(), _Actor({"steps": 4}))
    fleet.replicas[0].up = False
    assert asyncio.run(fleet.engine_metrics()) == {"generator/engine_steps": 4.0}
