"""The rollout processes of a run (rollout.processes >= 1): the step's groups are played
there (actors/rollout.py), each process routing its turns over every generator replica.

    procs = RolloutProcesses(config, log_dir)
    await procs.start(fleet)                 # spawned on this host; the fleet tells them
                                             # of deaths and rejoins from then on
    group = await procs.play_group(sample, group_id=7, step=3)   # process 7 % processes
    rollout = await procs.play_single(sample, group_id=5, sampling=greedy, step=-1)
                                             # validation sample 5, in process 5 % processes
    await procs.routed()                     # their routing counters, summed
    await procs.close()

Group g goes to process g % processes: every process gets an even share of each step, and
which process plays a group does not change what it generates (a request's tokens depend on
its own seed and context only). Validation sample i goes to process i % processes the same
way, one call per sample: a process plays its share concurrently as it does its groups, and
the controller's own env.workers pool is never started (a greedy request's tokens do not
depend on which process sent it either).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from torchtitan_rl.config import Config
from torchtitan_rl.controller.launcher import stop_meshes
from torchtitan_rl.types import Rollout, RolloutGroup, SamplingParams

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
"""How long a bookkeeping call (counters, activity, close) may take a rollout process."""


def process_names(count: int) -> tuple[str, ...]:
    """Actor names of `count` rollout processes (what the Supervisor reports)."""
    return tuple(f"rollout{i}" for i in range(count))


class RolloutProcesses:
    """`rollout.processes` RolloutActors on this host, one process each."""

    def __init__(self, config: Config, log_dir):
        self.config = config
        self.log_dir = None if log_dir is None else str(log_dir)
        """Where each process's fault log goes (actors/fault_log.py); None: none."""
        self.names = process_names(config.rollout.processes)
        self.meshes: list = []
        self.actors: list = []
        self._tasks: set[asyncio.Task] = set()
        self._told: dict[int, asyncio.Task] = {}
        """{process index: its last tell} (the next one waits for it)."""
        self._routed: list[dict | None] = []
        """Each process's last answer to `routed` (None before its first): a process that
        does not answer once counts with it, so the sums never go back (a negative count
        of rerouted requests, then the old ones counted again)."""

    async def start(self, fleet) -> None:
        """Spawn the processes over the fleet's replicas (the fleet, which owns this
        object, tells them of every death and rejoin)."""
        from monarch.actor import this_host

        from torchtitan_rl.actors.rollout import RolloutActor

        host = this_host()
        for name in self.names:
            mesh = host.spawn_procs(per_host={"procs": 1})
            self.meshes.append(mesh)
            self.actors.append(
                mesh.spawn(
                    name,
                    RolloutActor,
                    config=self.config,
                    actor_name=name,
                    replicas=[r.actor for r in fleet.replicas],
                    replica_names=[r.name for r in fleet.replicas],
                    failover=fleet.survives,
                    log_dir=self.log_dir,
                )  # fmt: skip
            )

    async def play_group(self, sample: dict[str, Any], *, group_id: int, step: int) -> RolloutGroup:
        actor = self.actors[group_id % len(self.actors)]
        return await actor.play_group.call_one(sample, group_id, step)

    async def play_single(
        self, sample: dict[str, Any], *, group_id: int, sampling: SamplingParams, step: int
    ) -> Rollout:
        """One rollout of `sample` (rollout id 0), in process group_id % processes."""
        actor = self.actors[group_id % len(self.actors)]
        return await actor.play_single.call_one(sample, group_id, sampling, step)

    # ---- what the fleet tells them --------------------------------------------------------
    def replica_down(self, index: int) -> None:
        self._tell("replica_down", index)

    def replica_up(self, index: int, actor, name: str) -> None:
        self._tell("replica_up", index, actor, name)

    def _tell(self, endpoint: str, *args) -> None:
        """Call `endpoint` on every process, not waiting (the fleet's callers are sync); a
        failure is logged (a dead rollout process ends the run through the Supervisor).
        Each process hears the tells in the order they were made: a tell is sent once the
        one before it was answered (a down told from the Supervisor's callback and an up
        told from the run are sent by different Monarch actors, whose messages may
        otherwise overtake each other)."""

        async def tell(actor, before: asyncio.Task | None):
            if before is not None:
                await asyncio.wait([before])
            try:
                await getattr(actor, endpoint).call_one(*args)
            except Exception as e:
                logger.warning("telling a rollout process %s%s: %s", endpoint, args[:1], e)

        for i, actor in enumerate(self.actors):
            task = asyncio.get_running_loop().create_task(tell(actor, self._told.get(i)))
            self._told[i] = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # ---- reports ----------------------------------------------------------------------------
    async def routed(self) -> tuple[list[int], list[int], int]:
        """Calls and call cost sent per replica and calls rerouted since start, summed over
        the processes (empty lists with one replica); a process that does not answer counts
        with its last answer."""
        answers = await asyncio.gather(
            *(asyncio.wait_for(a.routed.call_one(), CALL_TIMEOUT_S) for a in self.actors),
            return_exceptions=True,
        )
        last = self._routed + [None] * (len(answers) - len(self._routed))
        self._routed = [
            last[i] if isinstance(got, BaseException) else got for i, got in enumerate(answers)
        ]
        calls: list[int] = []
        tokens: list[int] = []
        rerouted = 0
        for got in self._routed:
            if got is None:
                continue
            calls = _add(calls, got["calls"])
            tokens = _add(tokens, got["tokens"])
            rerouted += got["rerouted"]
        return calls, tokens, rerouted

    async def activity(self) -> list[str]:
        answers = await asyncio.gather(
            *(asyncio.wait_for(a.activity.call_one(), CALL_TIMEOUT_S) for a in self.actors),
            return_exceptions=True,
        )
        return [
            f"{name}: no answer ({got!r})" if isinstance(got, BaseException) else got
            for name, got in zip(self.names, answers, strict=True)
        ]

    async def close(self) -> None:
        """Stop their env.workers processes, then their meshes (bounded waits)."""
        for task in list(self._tasks):
            task.cancel()
        for name, actor in zip(self.names, self.actors):  # those spawned
            try:
                await asyncio.wait_for(actor.close.call_one(), CALL_TIMEOUT_S)
            except Exception as e:
                logger.info("%s close: %s", name, e)
        await stop_meshes(self.meshes)


def _add(total: list[int], more: list[int]) -> list[int]:
    if not total:
        return list(more)
    return [a + b for a, b in zip(total, more, strict=True)]
