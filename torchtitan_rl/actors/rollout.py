"""A rollout process (rollout.processes >= 1): plays the groups the controller hands it,
calling every generator replica itself.

With hundreds of concurrent multi-turn rollouts one event loop cannot feed several
generator GPUs: each turn is a call out and an answer back on it (docs/benchmarks.md, "The
controller's turn rate"). A rollout process holds its own environment, renderer and
Rollouter (and its own env.workers) and routes its turns over the replicas by its own view
of their load; the controller makes one call per group instead of one per turn, and one per
validation sample (`play_single`), so the controller's own env.workers never start.

The fleet (controller/fleet.py) tells it when a replica dies (`replica_down`: its calls
there go to the live replicas) and when a restarted one holds the current weights
(`replica_up`).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from monarch.actor import Actor, concurrent_endpoint

from torchtitan_rl.actors.fault_log import enable_fault_log
from torchtitan_rl.actors.generate_fn import ActorGenerateFn
from torchtitan_rl.actors.process_exit import exit_at_stop
from torchtitan_rl.config import Config
from torchtitan_rl.envs import build_environment
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.models.tokenizer import Tokenizer
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.rollout.router import Router
from torchtitan_rl.types import Rollout, RolloutGroup, SamplingParams


class RolloutActor(Actor):
    """Plays groups of rollouts against the generator replicas it is given."""

    def __init__(
        self, *, config: Config, actor_name: str, replicas: list, replica_names: list[str],
        failover: bool, log_dir: str | None = None,
    ):  # fmt: skip
        """`replicas`: the generator actors, in replica order, named `replica_names`;
        `failover`: a call on a dead replica goes to a live one (the fleet survives deaths)."""
        self.fault_log = enable_fault_log(log_dir, actor_name, 0)
        exit_at_stop()
        self.name = actor_name
        renderer = Renderer(Tokenizer.from_file(config.model.hf_checkpoint or None))
        environment = build_environment(config.env, config.job.seed, config.env_args())
        self.rollouter = Rollouter(
            environment, renderer, config.env, config.rollout, config.job.seed
        )
        self.failover = failover
        self.fns = [
            ActorGenerateFn(actor, n, failover=failover)
            for actor, n in zip(replicas, replica_names, strict=True)
        ]
        self.router = Router(self.fns) if len(self.fns) > 1 else None
        self.generate_fn = self.router or self.fns[0]

    @concurrent_endpoint
    async def play_group(self, sample: dict[str, Any], group_id: int, step: int) -> RolloutGroup:
        """`rollout.group_size` sibling rollouts of `sample`, played and scored."""
        return await self.rollouter.run_group_rollouts(
            sample, self.generate_fn, group_id=group_id, step=step
        )

    @concurrent_endpoint
    async def play_single(
        self, sample: dict[str, Any], group_id: int, sampling: SamplingParams, step: int
    ) -> Rollout:
        """One rollout of `sample` (rollout id 0) with `sampling`, played and scored: a
        validation sample's greedy rollout."""
        return await self.rollouter.run_single_rollout(
            sample, self.generate_fn, group_id=group_id, rollout_id=0, sampling=sampling,
            step=step,
        )  # fmt: skip

    @concurrent_endpoint
    async def replica_down(self, index: int) -> None:
        """Replica `index` died: its calls in flight and later ones go to the live ones."""
        if self.router is not None:
            self.router.set_down(index)
        self.fns[index].fail_in_flight()

    @concurrent_endpoint
    async def replica_up(self, index: int, actor, name: str) -> None:
        """Replica `index` is `actor` now (restarted, holding the current weights; only a
        fleet of two or more replicas restarts one, so there is a router)."""
        fn = ActorGenerateFn(actor, name, failover=self.failover)
        self.fns[index] = fn
        self.router.replicas[index] = fn
        self.router.set_up(index)

    @concurrent_endpoint
    async def routed(self) -> dict[str, Any]:
        """Counters since start: calls and call cost sent per replica (empty with one
        replica), calls rerouted; and the calls in flight per replica now."""
        r = self.router
        return {
            "calls": list(r.routed) if r is not None else [],
            "tokens": list(r.routed_tokens) if r is not None else [],
            "rerouted": r.rerouted if r is not None else 0,
            "in_flight": [len(fn.in_flight) for fn in self.fns],
        }

    @concurrent_endpoint
    async def activity(self) -> str:
        """What this process waits on, for a step that waited too long for its batch."""
        calls = sum(len(fn.in_flight) for fn in self.fns)
        return f"{self.name}: {calls} generate call(s) in flight"

    @concurrent_endpoint
    async def where(self) -> dict:
        return {"role": self.name, "rank": 0, "host": socket.gethostname(), "pid": os.getpid(),
                "device": "cpu"}  # fmt: skip

    @concurrent_endpoint
    async def close(self) -> None:
        """Stop the env.workers processes."""
        self.rollouter.close()
