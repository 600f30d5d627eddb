"""The generator replicas of a run, owned in one place: their processes, the GenerateFn the
Rollouter calls, weight delivery, liveness, activity and close.

    fleet = GeneratorFleet(config, supervisor, vocab_size=..., log_dir=...)
    await fleet.start(meshes, trainer, hf_folder)
    completion = await fleet.generate_fn(prompt_ids, request_id=..., session_id=...)
    seconds = await fleet.sync()          # every replica that is up holds fleet.version
    fleet.metrics()                        # generator/replicas_alive, .../requests_rerouted
    await fleet.step_metrics()             # those, and what the engines did since the last call
    await fleet.close()

A dead replica (generator.num_replicas >= 2, generator.on_replica_death = "restart"):
1. Its process on this host is seen gone (`_watch_here`, every LOOK_HERE_S), a call on it
   raises `ReplicaDown`, or the Supervisor asks `survive(name)` instead of ending the run.
   The router takes no more calls there, and its calls in flight go to the least loaded
   live replica (a call carries its whole context and its own seed; a replica gives it the
   same tokens whatever else it serves).
2. A new process is spawned on the dead one's host, under a new actor name
   (generator1 -> generator1_r1: a late report of the old process cannot be taken for the
   new one), and its engine is built while the others serve.
3. At the next weight sync, the broadcast group is formed again over the live replicas and
   the new one; it receives the same version as the others and only then takes calls (one
   that came up during a sync over the others waits for the next). So no request is served
   by weights other than the version the others hold.
If every replica stays down for `generator.replicas_down_timeout_s`, the run stops with one
line. With one replica, or on_replica_death = "stop", a death ends the run (Supervisor).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from pathlib import Path

from torchtitan_rl.actors.generate_fn import ActorGenerateFn, is_death
from torchtitan_rl.config import Config
from torchtitan_rl.controller.fleet_report import FleetReport, fleet_activity
from torchtitan_rl.controller.launcher import Meshes, spawn_generator
from torchtitan_rl.controller.processes import on_this_machine, started
from torchtitan_rl.controller.replica import Replica, parse_replica_name, replica_name
from torchtitan_rl.controller.rollout_processes import RolloutProcesses, process_names
from torchtitan_rl.controller.supervision import PEER_REPORT_WAIT_S, Supervisor
from torchtitan_rl.generation.backends import traits
from torchtitan_rl.rollout.router import Router
from torchtitan_rl.types import GenerateFn
from torchtitan_rl.weight_sync.broadcast import BroadcastBroken
from torchtitan_rl.weight_sync.transport import WeightSync

logger = logging.getLogger(__name__)

RESTART_TIMEOUT_S = 900.0
"""How long a replica's new process may take to start and build its engine (vLLM compiles
and captures graphs for minutes) before the attempt counts as failed."""
RESTART_RETRY_S = 10.0
"""Pause between attempts to restart a replica (its host may be coming back)."""
HOST_REPORT_MARGIN_S = 20.0
"""A whole host's death is reported launcher.host_timeout_s + ~9 s after it: a broken sync
waits that long (and at least PEER_REPORT_WAIT_S) for the report before it counts as no death."""
LOOK_HERE_S = 0.2
"""How often the replicas' processes on this host are looked at (when deaths are survived)."""
SYNC_ATTEMPTS = 3
"""Weight syncs tried when replicas die during one (each retry is over the live ones)."""


class MemberDied(RuntimeError):
    """A weight sync given up because one of its members died during it."""


class GeneratorFleet:
    """Owns the generator replicas; the Controller uses its verbs only. It adds its actors'
    names (replicas, rollout processes, restarts) to the Supervisor's."""

    def __init__(self, config: Config, supervisor: Supervisor, *, vocab_size: int, log_dir):
        self.config = config
        self.supervisor = supervisor
        self.vocab_size = vocab_size
        self.log_dir = str(log_dir)
        n = config.generator.num_replicas
        ours = (*self.names, *process_names(config.rollout.processes))
        supervisor.names = (*supervisor.names, *(a for a in ours if a not in supervisor.names))
        self.survives = n >= 2 and config.generator.on_replica_death == "restart"
        """Whether a dead replica is survived (else any death ends the run)."""
        self.replicas: list[Replica] = []
        self.router: Router | None = None
        self.generate_fn: GenerateFn | None = None
        """What the Rollouter calls: the router over the replicas, or the one replica."""
        self.rollout = None
        """The rollout processes (controller/rollout_processes.py), when rollout.processes
        >= 1: told of every death and rejoin; their routing is reported with the router's."""
        self.weight_sync: WeightSync | None = None
        self.version: int | None = None
        """The policy version the last sync delivered."""
        self.meshes: Meshes | None = None
        self.trainer = None
        self.hf_folder = ""
        self.restarts: set[asyncio.Task] = set()
        self.local_processes: list[tuple[dict, int]] = []
        """Restarted replicas' processes on this host, with their start times (the
        controller kills those left over at close, as it does its first ones)."""
        self.first_processes: list[tuple[dict, int]] = []
        """The run's first processes on this host with their start times (the controller's
        record); with `local_processes`, what `_watch_here` looks at."""
        self._members: tuple[str, ...] = ()
        """Actor names the current weight sync was formed over."""
        self._regroup = False  # see `regroup`
        self.report = FleetReport()
        """The counters last reported (`metrics`, `engine_metrics` report since then)."""
        self._all_down: asyncio.TimerHandle | None = None
        self._closed = False
        self._watching: asyncio.Task | None = None
        """`_watch_here`, while deaths are survived."""
        self._context: contextvars.Context | None = None
        """The context `start` ran in (restarts spawn processes in it)."""
        self._sync_lock = asyncio.Lock()
        """One sync at a time: the step's, or one for replicas restarted while none was up."""
        self._member_died = asyncio.Event()
        """Set when a member of the sync in flight dies (`replica_down`)."""

    @property
    def names(self) -> tuple[str, ...]:
        """The first actor name of every replica (what the Supervisor starts with)."""
        return tuple(replica_name(i) for i in range(self.config.generator.num_replicas))

    @property
    def actors(self) -> list:
        """The replicas' actors, then the rollout processes' (rollout.processes)."""
        return [r.actor for r in self.replicas] + self._rollout_actors

    @property
    def _rollout_actors(self) -> list:
        return list(self.rollout.actors) if self.rollout is not None else []

    @property
    def play_group(self):
        """What plays a group of the step (`Rollouter.collect_batch`): the rollout
        processes' `play_group`, or None (the controller's loop plays it)."""
        return self.rollout.play_group if self.rollout is not None else None

    @property
    def play_single(self):
        """What plays a validation sample's rollout (`controller/validation.py`): the rollout
        processes' `play_single`, or None (the controller's loop plays it)."""
        return self.rollout.play_single if self.rollout is not None else None

    # ---- start ------------------------------------------------------------------------
    async def start(self, meshes: Meshes, trainer, run_dir: Path) -> None:
        """Spawn one generator per mesh (`open_weight_sync` then opens the sync)."""
        self.meshes, self.trainer = meshes, trainer
        self._context = contextvars.copy_context()
        self.hf_folder = await self.start_folder(run_dir)
        for i, mesh in enumerate(meshes.generators):
            actor = self._spawn(mesh, i, replica_name(i))
            fn = ActorGenerateFn(actor, replica_name(i), failover=self.survives)
            self.replicas.append(Replica(index=i, name=replica_name(i), actor=actor, fn=fn))
        fns = [r.fn for r in self.replicas]
        if len(fns) > 1:
            self.router = Router(fns, on_down=self._on_down)
        self.generate_fn = self.router or fns[0]
        if self.config.rollout.processes:
            self.rollout = RolloutProcesses(self.config, self.log_dir)
            await self.rollout.start(self)
            for actor in self.rollout.actors:
                self.supervisor.own(actor)
        if self.survives:
            self.supervisor.survive = self.survive
            self._watching = asyncio.ensure_future(self._watch_here())

    async def start_folder(self, run_dir: Path) -> str:
        """The Hugging Face folder a backend that starts from one (vllm) starts from:
        model.hf_checkpoint, or the trainer's initial policy exported in the generator's
        dtype (model.hf_checkpoint, often "", for one that does not)."""
        cfg = self.config
        if not traits(cfg.generator.backend).starts_from_hf_folder or cfg.model.hf_checkpoint:
            return cfg.model.hf_checkpoint
        folder = run_dir / "generator_start_hf"
        self.supervisor.where = "while exporting the generator's starting weights"
        await self.trainer.export_hf.call(str(folder), "", cfg.generator.dtype)
        return str(folder)

    async def open_weight_sync(self) -> None:
        """The weight sync over the replicas that are up or joining (called at start, and
        again by `sync` when the membership changed)."""
        cfg = self.config
        if self.weight_sync is not None:
            await self.weight_sync.close()
        # one look after the old group closed: a replica that started joining meanwhile is
        # in the group, and each name is that of the process the group opens over
        members = [(r.name, r.actor) for r in self.replicas if r.up or r.joining]
        t0 = time.perf_counter()
        self.weight_sync = await WeightSync.create(
            self.trainer, [actor for _, actor in members], cfg.generator.dtype,
            cfg.weight_sync.transport,
        )  # fmt: skip
        self.weight_sync.peer_failure_wait_s = max(30.0, cfg.launcher.host_timeout_s + 20.0)
        self._members, self._regroup = tuple(name for name, _ in members), False
        sync = self.weight_sync
        backend = f" ({sync.backend})" if sync.backend else ""
        base = f", the base to {sync.base_sent_to} first" if sync.base_sent_to else ""
        logger.info(
            "weight sync: %s%s, %s%s; opened in %.2f s",
            sync.transport, backend, sync.payload, base, time.perf_counter() - t0,
        )  # fmt: skip

    def regroup(self) -> None:
        """The next `sync` opens a new group (after the warm start changed the [lora] base,
        which goes out first when one opens), inside its retries: a death meanwhile is survived."""
        self._regroup = True

    def _spawn(self, mesh, index: int, name: str):
        placement = self.meshes.placement
        gpu = placement.generators[index] if placement.gpus else None
        actor = spawn_generator(
            mesh, name, self.config, vocab_size=self.vocab_size, log_dir=self.log_dir,
            hf_folder=self.hf_folder, gpu=gpu,
        )  # fmt: skip
        self.supervisor.own(actor)
        return actor

    @property
    def live_actors(self) -> list:
        """The actors of the replicas that are up, then the rollout processes'."""
        return [r.actor for r in self.replicas if r.up] + self._rollout_actors

    # ---- weights ------------------------------------------------------------------------
    async def sync(self) -> float:
        """Every replica that is up, and every restarted one, gets the trainer's current
        weights; restarted ones take calls from then on. Returns the seconds it took."""
        async with self._sync_lock:
            return await self._sync()

    async def _sync(self) -> float:
        t0 = time.perf_counter()
        for attempt in range(SYNC_ATTEMPTS):
            members = tuple(r.name for r in self.replicas if r.up or r.joining)
            self._member_died.clear()
            try:
                if self.weight_sync is None or members != self._members or self._regroup:
                    await self.open_weight_sync()  # a member may die here too
                    # the group as it opened: a replica may have started joining meanwhile
                    members = self._members
                    # one outside the last group is not taken for a member as it dies
                    if not set(members) <= {r.name for r in self.replicas if r.up or r.joining}:
                        raise MemberDied("a member of the weight sync died while it opened")
                await self._unless_a_member_dies(self.weight_sync())
                break
            except Exception as e:
                if not self.survives or attempt == SYNC_ATTEMPTS - 1:
                    raise
                if not await self._a_member_died(e, members):
                    raise
                logger.warning("weight sync: a replica died during it; again over the live ones")
        self.version = self.weight_sync.version
        for replica in self.replicas:
            if replica.joining and replica.name in members:  # not one restarted meanwhile
                self._rejoin(replica)
        return time.perf_counter() - t0

    async def _unless_a_member_dies(self, sync) -> None:
        """Await `sync`, but give it up as soon as one of its members is known dead: the
        live members would otherwise wait out the broadcast's peer timeout (30 s and more)
        for bytes that never come; the next attempt's new group closes the old one. A
        member whose process on this host is gone is known dead within LOOK_HERE_S
        (`_watch_here`)."""
        task = asyncio.ensure_future(sync)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read, always
        died = asyncio.ensure_future(self._member_died.wait())
        try:
            await asyncio.wait({task, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this call is cancelled (the run stops): the sync goes with it
            died.cancel()
            if not task.done():
                task.cancel()
        if not task.done() or task.cancelled():
            raise MemberDied("a member of the weight sync died during it")
        task.result()

    async def _a_member_died(self, error: BaseException, members: tuple[str, ...]) -> bool:
        """After a failed sync over `members`: whether one of them is now known dead (waiting
        for the Supervisor's report when the error itself does not say so). Not against
        `_members`: after a failed reopen those are the last group's, not the attempt's."""
        if isinstance(error, MemberDied):
            return True
        if not (is_death(error) or isinstance(error, BroadcastBroken)):
            return False
        loop = asyncio.get_running_loop()
        host = self.config.launcher.host_timeout_s + HOST_REPORT_MARGIN_S
        wait = max(PEER_REPORT_WAIT_S, host)
        deadline = loop.time() + wait
        while loop.time() < deadline:
            self._mark_gone_here()
            live = tuple(r.name for r in self.replicas if r.up or r.joining)
            if live != members:
                return True
            await asyncio.sleep(0.2)
        error.reports_awaited = True  # the Supervisor need not wait for a report again
        return False

    async def _watch_here(self) -> None:
        """From start to close, every LOOK_HERE_S: `_mark_gone_here`."""
        while not self._closed:
            await asyncio.sleep(LOOK_HERE_S)
            self._mark_gone_here()

    def _mark_gone_here(self) -> None:
        """Replicas whose process on this host is gone are down now. Monarch's report of a
        death comes 2-10 s after it, and meanwhile the dead replica's calls hang (an H200:
        8-10 s) and a sync to it breaks or hangs. Only when deaths are survived: else the
        Supervisor's report ends the run, with its line."""
        if not self.survives:
            return
        for where, t in self.first_processes + self.local_processes:
            if started(where["pid"]) == t:
                continue
            for replica in self.replicas:
                if replica.name == where["role"] and (replica.up or replica.joining):
                    self.replica_down(replica.index)

    def _rejoin(self, replica: Replica) -> None:
        replica.joining, replica.up = False, True
        if self.router is not None:
            self.router.set_up(replica.index)
        if self.rollout is not None:
            self.rollout.replica_up(replica.index, replica.actor, replica.name)
        self._cancel_all_down()
        logger.warning(
            "%s rejoined after %.0f s, at policy version %s",
            replica.name, time.monotonic() - replica.down_since, self.version,
        )  # fmt: skip

    # ---- deaths -------------------------------------------------------------------------
    def survive(self, name: str) -> bool:
        """The Supervisor's question for a dead actor `name`: True when it is a replica (or
        an older or still starting process of one) the run carries on without."""
        parsed = parse_replica_name(name)
        if parsed is None or parsed[0] >= len(self.replicas):
            return False
        replica = self.replicas[parsed[0]]
        if name == replica.name:
            self.replica_down(replica.index)
        return parsed[1] <= replica.incarnation  # else no such process was ever started

    def _on_down(self, index: int) -> None:
        """The router saw a call fail with ReplicaDown."""
        self.replica_down(index)

    def replica_down(self, index: int) -> None:
        """Replica `index` died: no more calls or weights for it; restart it."""
        replica = self.replicas[index]
        if not replica.up and not replica.joining:
            return
        if self._closed:
            return
        was_joining = replica.joining
        if replica.name in self._members:
            self._member_died.set()
        replica.up = replica.joining = False
        replica.down_since = time.monotonic()
        replica.fn.fail_in_flight()
        self.supervisor.survived_death(replica.name)
        moved = len(replica.fn.in_flight)
        if self.router is not None:
            self.router.set_down(index)
        if self.rollout is not None:
            self.rollout.replica_down(index)
        alive = sum(r.up for r in self.replicas)
        # the rollout processes' calls there move too; they count them in requests_rerouted
        theirs = " (and the rollout processes' requests there)" if self.rollout is not None else ""
        logger.warning(
            "%s died%s; %d request(s) in flight%s go to the %d live replica(s); restarting it",
            replica.name, " before it rejoined" if was_joining else "", moved, theirs, alive,
        )  # fmt: skip
        if alive == 0:
            self._start_all_down_timer()
            if any(r.joining for r in self.replicas):  # restarted ones, ready for weights
                self._track(self._weights_for_joining())
        self._track(self._restart(replica))

    def _track(self, coroutine) -> None:
        """Run `coroutine` as a task that `close` cancels, in the run's context: a death
        reported on Monarch's thread arrives outside it, and spawning a process (or a sync)
        needs the Monarch client context the run started in."""
        task = asyncio.get_running_loop().create_task(coroutine, context=self._context)
        self.restarts.add(task)
        task.add_done_callback(self.restarts.discard)

    async def _restart(self, replica: Replica) -> None:
        """A new process for `replica` on its host, until one starts; it joins at the next
        sync."""
        while not self._closed:
            replica.incarnation += 1
            name = replica_name(replica.index, replica.incarnation)
            self.supervisor.names = (*self.supervisor.names, name)
            try:
                actor = await asyncio.wait_for(self._respawn(replica, name), RESTART_TIMEOUT_S)
            except Exception as e:
                logger.warning(
                    "restarting %s failed (%s); again in %g s", name, e, RESTART_RETRY_S,
                    exc_info=logger.isEnabledFor(logging.DEBUG),
                )  # fmt: skip
                await asyncio.sleep(RESTART_RETRY_S)
                continue
            replica.actor, replica.name = actor, name
            replica.fn = ActorGenerateFn(actor, name, failover=True)
            if self.router is not None:
                self.router.replicas[replica.index] = replica.fn
            replica.joining = True
            logger.warning("%s restarted as %s; it takes calls after the next weight sync",
                           replica_name(replica.index), name)  # fmt: skip
            # with none up, no step can finish to sync them in: they get the trainer's weights
            # now (newer than the batch in flight was started with; still within the bound)
            await self._weights_for_joining()
            return

    async def _weights_for_joining(self) -> None:
        """With no replica up, restarted ones would wait for the next step's sync, which no
        step can reach: they get the trainer's weights at once (after a restart, or when the
        last replica up died). Nothing when a replica is up or none is restarted."""
        async with self._sync_lock:
            if any(r.up for r in self.replicas) or not any(r.joining for r in self.replicas):
                return
            try:
                await self._sync()
            except Exception as e:
                logger.warning("weights for the restarted replicas: %s", e)

    async def _respawn(self, replica: Replica, name: str):
        old = self.meshes.generators[replica.index]
        self.supervisor.survived_death()  # stopping it may report its death again
        stopping = asyncio.ensure_future(_stop(old, replica.name))  # meanwhile, bounded
        self.restarts.add(stopping)
        stopping.add_done_callback(self.restarts.discard)
        mesh = self.meshes.respawn_generator(replica.index)
        actor = self._spawn(mesh, replica.index, name)
        where = await actor.where.call_one()  # waits for its engine to be built
        self.local_processes.extend(on_this_machine([where]))
        return actor

    def _start_all_down_timer(self) -> None:
        if self._all_down is None:
            timeout = self.config.generator.replicas_down_timeout_s
            loop = asyncio.get_running_loop()
            self._all_down = loop.call_later(timeout, self._all_down_too_long, timeout)

    def _cancel_all_down(self) -> None:
        if self._all_down is not None:
            self._all_down.cancel()
            self._all_down = None

    def _all_down_too_long(self, timeout: float) -> None:
        self.supervisor.stop_run(
            f"every generator replica was down for {timeout:g} s "
            f"(generator.replicas_down_timeout_s); the run stops"
        )

    # ---- reports ------------------------------------------------------------------------
    def metrics(self, more: tuple[list[int], list[int], int] | None = None) -> dict[str, float]:
        """Replicas alive, requests rerouted and the spread of calls since the last call
        (`FleetReport.routing`); `more`: the rollout processes' counters since start."""
        return self.report.routing(self.replicas, self.router, more)

    async def step_metrics(self) -> dict[str, float]:
        """`metrics()` and `engine_metrics()`, for a step's report."""
        more = await self.rollout.routed() if self.rollout is not None else None
        return {**self.metrics(more), **await self.engine_metrics()}

    async def engine_metrics(self) -> dict[str, float]:
        """What the engines of the replicas that are up did since the last call
        (`FleetReport.engines`)."""
        return await self.report.engines(self.replicas)

    async def activity(self) -> str:
        """What every replica is doing, for a step that waited too long for its batch."""
        return await fleet_activity(self.replicas, self.rollout, self.config.env.step_timeout_s)

    async def close(self) -> None:
        """Stop restarts and close every replica's engine (bounded: one may be dead)."""
        self._closed = True
        self._cancel_all_down()
        if self._watching is not None:
            self._watching.cancel()
        for task in list(self.restarts):
            task.cancel()
        await asyncio.gather(*self.restarts, return_exceptions=True)
        if self.rollout is not None:
            await self.rollout.close()
        for replica in self.replicas:
            if not (replica.up or replica.joining):
                continue
            try:
                await asyncio.wait_for(replica.actor.close.call_one(), timeout=10)
            except Exception as e:
                logger.info("%s close: %s", replica.name, e)


async def _stop(mesh, name: str) -> None:
    """Stop a dead replica's mesh, within 10 s; a failure to stop is only logged."""
    try:
        await asyncio.wait_for(mesh.stop(), timeout=10)
    except Exception as e:
        logger.debug("stopping %s's mesh: %s", name, e)
