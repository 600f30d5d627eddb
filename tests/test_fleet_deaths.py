"""Replica deaths through the fleet's own verbs (controller/fleet.py): `start` spawns fake
generator processes on fake meshes, a death comes as the Supervisor's report or as
`replica_down`, and a restart spawns a new fake process on the replica's fake host."""

import asyncio
import re

import numpy as np
import pytest
from test_failover import _fleet
from test_faults import KILLED, _Failure

from torchtitan_rl.controller import supervision
from torchtitan_rl.controller.launcher import Meshes
from torchtitan_rl.controller.supervision import ActorFailure
from torchtitan_rl.types import Completion, FinishReason

WATCH_LIMIT_S = 20.0
"""Bound on a scenario that should end on its own (a broken fleet fails, never hangs)."""


class _Endpoint:
    def __init__(self, fn):
        self.fn = fn

    def call_one(self, *args):
        return self.fn(*args)


class FakeGenerator:
    """A generator actor: answers `generate` at once with its name in the metrics, or never
    (`dead`: its process is gone); `where` answers once its host lets new processes start."""

    def __init__(self, name, host):
        self.name, self.host, self.calls, self.dead = name, host, [], False
        self.generate = _Endpoint(self._generate)
        self.where = _Endpoint(self._where)
        self.close = _Endpoint(self._close)

    async def _generate(self, prompt_ids, request_id, session_id, sampling):
        self.calls.append(request_id)
        if self.dead:
            await asyncio.Event().wait()  # a dead process never answers
        return Completion(
            request_id=request_id,
            token_ids_N=np.zeros(1, np.int32),
            logprobs_N=np.zeros(1, np.float32),
            finish_reason=FinishReason.STOP,
            metrics={"by": self.name},
        )

    async def _where(self):
        await self.host.starts.wait()
        return {"host": "another-host", "pid": 1}

    async def _close(self):
        return None


class FakeMesh:
    def __init__(self, host):
        self.host, self.actor = host, None

    def spawn(self, name, actor_class, **kwargs):
        self.actor = FakeGenerator(name, self.host)
        return self.actor

    async def stop(self):
        return None


class FakeHost:
    """A generator's host: a restart spawns its new process here; `starts` says whether a
    new process comes up (else the restart waits, as one whose engine is being built)."""

    def __init__(self, starts: bool):
        self.starts = asyncio.Event()
        if starts:
            self.starts.set()

    def spawn_procs(self, per_host):
        return FakeMesh(self)


class FakeSync:
    """The weight sync: records the members of each sync and delivers `version`."""

    version = 7

    def __init__(self, synced):
        self.synced = synced

    async def __call__(self):
        self.synced.append(self.members)


async def _start(fleet, *, restarts_start: bool, synced: list | None = None):
    """`fleet.start` over two fake processes; the weight sync is a FakeSync."""
    hosts = [FakeHost(restarts_start) for _ in range(2)]
    meshes = Meshes(trainer=None, generators=[FakeMesh(h) for h in hosts], generator_hosts=hosts)

    async def open_weight_sync():  # the members of the real one, without the transport
        fleet.weight_sync = FakeSync(synced if synced is not None else [])
        members = [r for r in fleet.replicas if r.up or r.joining]
        fleet.weight_sync.members = tuple(r.name for r in members)
        fleet._members = fleet.weight_sync.members

    fleet.open_weight_sync = open_weight_sync
    fleet.supervisor.install()
    await fleet.start(meshes, trainer=None, run_dir=None)
    return meshes


async def _watch(supervisor, awaitable):
    return await asyncio.wait_for(supervisor.watch(awaitable), WATCH_LIMIT_S)


async def _sync_first_broken(fleet, supervisor, synced: list, breaks) -> None:
    """`fleet.sync()`, watched, over a weight sync opened over both replicas whose first
    call records its members, then awaits `breaks()` (which kills, hangs or raises)."""
    await fleet.open_weight_sync()
    sync = fleet.weight_sync

    async def call():
        synced.append(sync.members)
        if len(synced) == 1:
            await breaks()

    sync.__class__ = type("Breaks", (FakeSync,), {"__call__": lambda self: call()})
    await _watch(supervisor, fleet.sync())


def _run_sync_first_broken(fleet, supervisor, breaks) -> list:
    """`_sync_first_broken` on a fleet started over fake processes, then closed; returns the
    members of each sync."""
    synced = []

    async def scenario():
        await _start(fleet, restarts_start=False, synced=synced)
        try:
            await _sync_first_broken(fleet, supervisor, synced, breaks)
        finally:
            await fleet.close()
            supervisor.uninstall()

    asyncio.run(scenario())
    return synced


def _process_of_replica_1(fleet):
    """A real process (`sleep 60`) recorded as replica 1's on this host."""
    import socket
    import subprocess

    from torchtitan_rl.controller.processes import started

    process = subprocess.Popen(["sleep", "60"])
    record = {"role": "generator1", "host": socket.gethostname(), "pid": process.pid}
    fleet.first_processes = [(record, started(process.pid))]
    return process


def _two_calls_as_replica_1_dies(fleet, supervisor, dies):
    """On a started fleet whose replica 1 never answers: two calls, one on each replica;
    `dies()` once replica 1 has its call. The answers, or the ActorFailure the run ends with."""

    async def scenario():
        meshes = await _start(fleet, restarts_start=False)
        dying = meshes.generators[1].actor
        dying.dead = True
        try:
            calls = [
                fleet.generate_fn(np.zeros(2, np.int32), request_id=f"r{i}", session_id=f"s{i}")
                for i in range(2)
            ]

            async def step():
                pending = asyncio.gather(*calls)
                while not dying.calls:
                    await asyncio.sleep(0.01)
                dies()
                return await pending

            return await _watch(supervisor, step())
        except ActorFailure as failure:
            return failure
        finally:
            await fleet.close()
            supervisor.uninstall()

    return asyncio.run(scenario())


# ---- every replica down (generator.replicas_down_timeout_s) --------------------------------
def test_every_replica_down_for_the_timeout_stops_the_run_with_one_line(tmp_path):
    fleet, supervisor = _fleet(tmp_path, "--generator.replicas_down_timeout_s=0.2")

    async def scenario():
        await _start(fleet, restarts_start=False)  # neither replica comes back
        try:
            fleet.replica_down(0)
            fleet.replica_down(1)
            with pytest.raises(ActorFailure) as failure:
                await _watch(supervisor, asyncio.get_running_loop().create_future())
            return str(failure.value)
        finally:
            await fleet.close()
            supervisor.uninstall()

    line = asyncio.run(scenario())
    assert line.startswith("every generator replica was down for 0.2 s")
    assert "generator.replicas_down_timeout_s" in line and "\n" not in line


def test_a_replica_that_rejoins_before_the_timeout_keeps_the_run_going(tmp_path, caplog):
    """Both die; their new processes start, are given weights by the fleet itself (no step
    can end to sync them in) and take calls: the all-down timer is cancelled with them."""
    timeout = 1.5  # the fake restarts take milliseconds; margin for a loaded host
    fleet, supervisor = _fleet(tmp_path, f"--generator.replicas_down_timeout_s={timeout}")
    synced = []

    async def scenario():
        await _start(fleet, restarts_start=True, synced=synced)
        try:
            loop = asyncio.get_running_loop()
            fleet.replica_down(0)
            fleet.replica_down(1)
            down_at = loop.time()

            async def past_the_timeout():
                while not any(r.up for r in fleet.replicas):  # (a fake restart: at once)
                    await asyncio.sleep(0.01)
                await asyncio.sleep(down_at + 2 * timeout - loop.time())
                return await fleet.generate_fn(np.zeros(2, np.int32), request_id="after")

            return await _watch(supervisor, past_the_timeout())
        finally:
            await fleet.close()
            supervisor.uninstall()

    answer = asyncio.run(scenario())
    assert supervisor.fatal is None
    assert fleet.version == FakeSync.version and synced[0][0].endswith("_r1")
    assert answer.metrics["by"] in {r.name for r in fleet.replicas if r.up}
    rejoined = [r.getMessage() for r in caplog.records if "rejoined" in r.getMessage()]
    assert rejoined and all(
        re.fullmatch(r"generator1?_r1 rejoined after \d+ s, at policy version 7", line)
        for line in rejoined
    )


def test_a_replica_restarted_while_a_sync_is_in_flight_joins_at_the_next_sync(tmp_path):
    """Replica 1 dies and its new process is up while a sync over replica 0 alone is in
    flight: that sync did not give it the weights, so it takes no calls until the next
    sync, which is formed over it too (seen on an H200: it served the start's weights and
    every rollout of a step was dropped as too stale)."""
    fleet, supervisor = _fleet(tmp_path)
    synced, release = [], asyncio.Event()

    async def scenario():
        await _start(fleet, restarts_start=True, synced=synced)
        try:
            fleet.replica_down(1)
            await fleet.open_weight_sync()  # over replica 0: the step's sync
            sync = fleet.weight_sync

            async def slow():
                synced.append(sync.members)
                await release.wait()

            sync.__class__ = type("Slow", (FakeSync,), {"__call__": lambda self: slow()})
            in_flight = asyncio.ensure_future(fleet.sync())
            while not fleet.replicas[1].joining:  # its restart is done (a fake: at once)
                await asyncio.sleep(0.01)
            release.set()
            await _watch(supervisor, in_flight)
            after_the_first = fleet.replicas[1].up
            await _watch(supervisor, fleet.sync())
            return after_the_first
        finally:
            await fleet.close()
            supervisor.uninstall()

    after_the_first = asyncio.run(scenario())
    assert after_the_first is False
    assert synced == [("generator",), ("generator", "generator1_r1")]
    assert fleet.replicas[1].up and fleet.router.down == set()


def test_a_restarted_replica_gets_the_weights_when_the_last_one_up_dies_before_the_sync(tmp_path):
    """Replica 1's new process is ready (joining) while replica 0 serves, and replica 0 dies
    before the step's sync, its new process not starting: no step can finish to sync replica
    1 in, so the fleet gives it the trainer's weights itself and it takes the calls (else
    both stay down until replicas_down_timeout_s ends the run)."""
    fleet, supervisor = _fleet(tmp_path)
    synced = []

    async def scenario():
        meshes = await _start(fleet, restarts_start=False, synced=synced)
        try:
            meshes.generator_hosts[1].starts.set()  # only replica 1's host starts a process
            fleet.replica_down(1)
            while not fleet.replicas[1].joining:
                await asyncio.sleep(0.01)
            fleet.replica_down(0)
            call = fleet.generate_fn(np.zeros(2, np.int32), request_id="r", session_id="s")
            return await _watch(supervisor, call)
        finally:
            await fleet.close()
            supervisor.uninstall()

    out = asyncio.run(scenario())
    assert out.metrics["by"] == "generator1_r1"
    assert synced == [("generator1_r1",)] and fleet.version == FakeSync.version
    assert [(r.up, r.joining) for r in fleet.replicas] == [(False, False), (True, False)]


# ---- generator.on_replica_death ------------------------------------------------------------
@pytest.mark.parametrize("policy", ["stop", "restart"])
def test_a_replica_death_ends_the_run_under_stop_and_is_rerouted_under_restart(
    tmp_path, monkeypatch, policy
):
    """Two calls in flight, one on each replica; replica 1's process dies (it never answers,
    and Monarch reports it). "stop": the Supervisor ends the run with its line, nothing is
    moved or restarted. "restart" (the default): its call is answered by replica 0."""
    monkeypatch.setattr(supervision, "FAILURE_GRACE_S", 0.1)
    fleet, supervisor = _fleet(tmp_path, f"--generator.on_replica_death={policy}")
    report = KILLED.replace("generator{", "generator1{")

    def dies():
        supervisor.where = "during RL step 3"
        supervisor._on_failure(_Failure(report))  # as from Monarch's thread

    out = _two_calls_as_replica_1_dies(fleet, supervisor, dies)
    if policy == "stop":
        assert isinstance(out, ActorFailure) and out.actor == "generator1"
        assert str(out).startswith("generator1 failed during RL step 3 (rank 0): ")
        assert fleet.router.rerouted == 0 and all(r.incarnation == 0 for r in fleet.replicas)
    else:
        assert [c.metrics["by"] for c in out] == ["generator", "generator"]
        assert fleet.router.rerouted == 1 and fleet.router.down == {1}
        assert fleet.replicas[1].incarnation == 1  # its restart began


def test_a_replica_process_gone_on_this_host_while_it_generates_is_heard_of_without_a_report(
    tmp_path,
):
    """Replica 1's process on this host is killed while a call is on it; the call hangs and
    Monarch's report never comes (on an H200 it came 8-10 s after the kill). The fleet sees
    the process gone and moves the call to replica 0 within a few LOOK_HERE_S."""
    fleet, supervisor = _fleet(tmp_path)
    process = _process_of_replica_1(fleet)

    def dies():
        process.kill()
        process.wait()

    try:
        out = _two_calls_as_replica_1_dies(fleet, supervisor, dies)
    finally:
        process.kill()
    assert [c.metrics["by"] for c in out] == ["generator", "generator"]
    assert fleet.router.rerouted == 1 and fleet.router.down == {1}
    assert fleet.replicas[1].incarnation == 1  # its restart began
