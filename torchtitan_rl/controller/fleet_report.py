"""What the generator fleet reports each step: replicas alive, requests rerouted, how evenly
calls were spread over the replicas, what each replica's engine did since the last report,
and what every replica is doing when a step waits too long.

    report = FleetReport()
    report.routing(replicas, router, more)   # generator/replicas_alive, .../requests_rerouted
    await report.engines(replicas)           # generator/engine_steps, .../weight_pull_ms
    await fleet_activity(replicas, rollout, step_timeout_s)

The counters read here (the router's, the engines') count since start; the report keeps
what it last saw and reports the difference.
"""

from __future__ import annotations

import asyncio
import time

from torchtitan_rl.controller.replica import Replica
from torchtitan_rl.rollout.router import Router

ENGINE_SUMS = ("steps", "drained_steps", "eager_prefills", "eager_prefill_tokens")
"""Engine counters reported as sums over the replicas."""


class FleetReport:
    """The fleet's counters as last reported, so each report holds what happened since."""

    def __init__(self):
        self._rerouted_reported = 0
        self._routed_reported: tuple[list[int], list[int]] | None = None
        self._engine_reported: dict[str, tuple[float, dict[str, float]]] = {}
        """{replica name: (clock, its engine_stats)} at the last `engines`."""

    def routing(
        self,
        replicas: list[Replica],
        router: Router | None,
        more: tuple[list[int], list[int], int] | None = None,
    ) -> dict[str, float]:
        """generator/replicas_alive now, and generator/requests_rerouted since the last
        call (0 with one replica); with several replicas, how evenly the calls since the
        last call were spread: the busiest replica's calls and call cost (prompt +
        max_tokens) over the mean of the replicas (1.0 = even). `more`: the rollout
        processes' counters since start (calls, cost per replica; rerouted), added to the
        router's."""
        calls = list(router.routed) if router is not None else []
        tokens = list(router.routed_tokens) if router is not None else []
        rerouted = router.rerouted if router is not None else 0
        if more is not None and more[0]:
            calls = [a + b for a, b in zip(calls, more[0], strict=True)]
            tokens = [a + b for a, b in zip(tokens, more[1], strict=True)]
            rerouted += more[2]
        since, self._rerouted_reported = rerouted - self._rerouted_reported, rerouted
        out = {
            "generator/replicas_alive": float(sum(r.up for r in replicas)),
            "generator/requests_rerouted": float(since),
        }
        if router is not None and len(replicas) > 1:
            now = (calls, tokens)
            last = self._routed_reported or ([0] * len(now[0]), [0] * len(now[1]))
            self._routed_reported = now
            for tag, new_counts, old_counts in (
                ("generator/routed_calls_max_over_mean", now[0], last[0]),
                ("generator/routed_tokens_max_over_mean", now[1], last[1]),
            ):
                delta = [a - b for a, b in zip(new_counts, old_counts)]
                if sum(delta):
                    out[tag] = max(delta) * len(delta) / sum(delta)
        return out

    async def engines(self, replicas: list[Replica]) -> dict[str, float]:
        """What the engines of the replicas that are up did since the last call (first
        call: since they started), from their `engine_stats`: the share of the time their
        driver was busy (mean), weight-pull milliseconds (mean), engine steps, steps built
        while no step was in flight, eager prefills and their tokens (sums). Empty where
        the engines report no counters (vLLM reports only the driver's seconds)."""
        up = [r for r in replicas if r.up and hasattr(r.actor, "engine_stats")]
        if not up:
            return {}
        stats = await asyncio.gather(
            *(asyncio.wait_for(r.actor.engine_stats.call_one(), 10) for r in up),
            return_exceptions=True,
        )
        now = time.perf_counter()
        busy, pull, sums = [], [], {}
        for replica, got in zip(up, stats):
            if isinstance(got, BaseException) or not got:
                continue
            then, last = self._engine_reported.get(replica.name, (None, {}))
            self._engine_reported[replica.name] = (now, got)
            delta = {k: v - last.get(k, 0) for k, v in got.items()}
            if then is not None and "busy_s" in delta and now > then:
                busy.append(delta["busy_s"] / (now - then))
                pull.append(1e3 * delta["pull_s"])
            for key in ENGINE_SUMS:
                if key in delta:
                    sums[key] = sums.get(key, 0.0) + delta[key]
        out = {f"generator/engine_{k}": float(v) for k, v in sums.items()}
        if busy:
            out["generator/engine_busy_fraction"] = sum(busy) / len(busy)
            out["generator/weight_pull_ms"] = sum(pull) / len(pull)
        return out


async def fleet_activity(replicas: list[Replica], rollout, step_timeout_s: float) -> str:
    """What every replica is doing, for a step that waited too long for its batch; `rollout`:
    the rollout processes (rollout.processes >= 1) or None."""
    phrases = [r.fn.activity() for r in replicas]
    if rollout is not None:
        return "; ".join([*phrases, *await rollout.activity()])
    if not any(r.fn.in_flight for r in replicas):
        phrases.append(
            f"so the rollouts wait on the environment (env.step_timeout_s={step_timeout_s:g})"
        )
    return "; ".join(phrases)
