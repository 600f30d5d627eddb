"""Weight syncs of a fleet whose replicas die (controller/fleet.py): a group reopened over a
restarted replica, a member dying while a group forms, and a broadcast broken or hung by a
death. The fakes and drivers are test_fleet_deaths.py's."""

import asyncio

import pytest
from test_failover import _fleet
from test_faults import KILLED, _Failure
from test_fleet_deaths import (
    WATCH_LIMIT_S,
    FakeHost,
    FakeMesh,
    FakeSync,
    _process_of_replica_1,
    _run_sync_first_broken,
    _start,
    _sync_first_broken,
    _watch,
)

from torchtitan_rl.controller.launcher import Meshes
from torchtitan_rl.controller.supervision import ActorFailure
from torchtitan_rl.weight_sync.transport import TransportUnavailable


# ---- a weight sync reopened over a restarted replica ---------------------------------------
@pytest.mark.parametrize("dies", [False, True])
def test_a_reopened_sync_that_fails_is_retried_only_when_a_member_died(
    tmp_path, monkeypatch, caplog, dies
):
    """Replica 1 died and its new process joins: the sync is opened again over the new
    members. A named transport that cannot open for another reason (no free port) ends the
    run with its own line after one try, not taken for a death; when the joining process
    dies while the group forms, the sync is tried again over the live ones. The fleet waited
    for a report of a death already: the Supervisor does not wait for one again."""
    from torchtitan_rl.controller import fleet as fleet_module

    monkeypatch.setattr(fleet_module, "PEER_REPORT_WAIT_S", 0.3)
    monkeypatch.setattr(fleet_module, "HOST_REPORT_MARGIN_S", -0.7)  # 0.3 s with 1 s hosts
    fleet, supervisor = _fleet(tmp_path, "--launcher.host_timeout_s=1")
    opened, waits = [], []

    async def wait_for_named_report(*args, **kwargs):
        waits.append(args)

    monkeypatch.setattr(supervisor, "_wait_for_named_report", wait_for_named_report)

    async def scenario():
        await _start(fleet, restarts_start=True)
        try:
            await fleet.open_weight_sync()  # at start, over both replicas
            good_open = fleet.open_weight_sync
            fleet.replica_down(1)
            while not fleet.replicas[1].joining:
                await asyncio.sleep(0.01)

            async def open_weight_sync():
                opened.append(tuple(r.name for r in fleet.replicas if r.up or r.joining))
                if len(opened) > 1:
                    return await good_open()
                if dies:
                    fleet.replica_down(1)  # as the Supervisor's report of it would
                raise TransportUnavailable('weight_sync.transport = "broadcast" could not be '
                                           "opened (OSError: no free port)")  # fmt: skip

            fleet.open_weight_sync = open_weight_sync
            await _watch(supervisor, fleet.sync())
        finally:
            await fleet.close()
            supervisor.uninstall()

    retried = "weight sync: a replica died during it; again over the live ones"
    if dies:
        asyncio.run(scenario())
        assert len(opened) == 2 and fleet.version == FakeSync.version
        assert [r.getMessage() for r in caplog.records].count(retried) == 1
    else:
        with pytest.raises(TransportUnavailable, match="no free port"):
            asyncio.run(scenario())
        assert opened == [("generator", "generator1_r1")]
        assert retried not in [r.getMessage() for r in caplog.records]
        assert waits == []  # the line stands after the fleet's wait (0.3 s here), not 30 s more


def test_a_joining_process_gone_while_the_group_opens_is_not_waited_for_in_the_sync(tmp_path):
    """Replica 1's new process joins the group the sync opens, and is killed while it opens:
    the fleet sees it gone at once (outside the last group, so not as a member of it). The
    group that opened over it is not used (a broadcast to a dead peer waits out its peer
    timeout, 30 s and more): the sync is tried again over the live ones."""
    import socket
    import subprocess

    from torchtitan_rl.controller.processes import started

    fleet, supervisor = _fleet(tmp_path)
    synced, opened, joined = [], [], subprocess.Popen(["sleep", "60"])

    async def scenario():
        await _start(fleet, restarts_start=True, synced=synced)
        try:
            await fleet.open_weight_sync()
            fleet._members = fleet.weight_sync.members = ("generator",)  # the last step's
            fleet.replica_down(1)
            while not fleet.replicas[1].joining:
                await asyncio.sleep(0.01)
            record = {"role": "generator1_r1", "host": socket.gethostname(), "pid": joined.pid}
            fleet.local_processes.append((record, started(joined.pid)))
            fake_open, formed = fleet.open_weight_sync, asyncio.Event()

            async def open_weight_sync():  # as the real one: over those up or joining now
                opened.append(tuple(r.name for r in fleet.replicas if r.up or r.joining))
                if len(opened) == 1:
                    await formed.wait()
                await fake_open()
                fleet._members = fleet.weight_sync.members = opened[-1]
                live = {r.name for r in fleet.replicas if r.up or r.joining}
                if not set(opened[-1]) <= live:  # a broadcast to a dead peer
                    fleet.weight_sync.__class__ = type(
                        "ToTheDead", (FakeSync,), {"__call__": lambda self: asyncio.Event().wait()}
                    )

            fleet.open_weight_sync = open_weight_sync
            syncing = asyncio.ensure_future(_watch(supervisor, fleet.sync()))
            while not opened:
                await asyncio.sleep(0.01)
            joined.kill()
            joined.wait()
            while fleet.replicas[1].incarnation < 2:  # heard of; restarted (a fake: at once)
                await asyncio.sleep(0.01)
            formed.set()
            await syncing
        finally:
            await fleet.close()
            supervisor.uninstall()
            joined.kill()

    asyncio.run(scenario())
    assert opened == [("generator", "generator1_r1"), ("generator", "generator1_r2")]
    assert synced == [("generator", "generator1_r2")] and fleet.replicas[1].up


class _Group:
    """The weight sync the real `open_weight_sync` opens: over the actors it is given, each
    of which gets `version`; `closing` runs while the old group closes."""

    version, closing = 7, None
    transport, backend, payload, base_sent_to = "broadcast", "gloo", "full weights", ""

    def __init__(self, actors):
        self.actors = actors

    @classmethod
    async def create(cls, trainer, actors, dtype, transport):
        return cls(actors)

    async def close(self):
        if _Group.closing is not None:
            await _Group.closing()

    async def __call__(self):
        for actor in self.actors:
            actor.version = self.version


def test_a_replica_that_starts_joining_while_the_group_opens_takes_calls_after_that_sync(
    tmp_path, monkeypatch
):
    """Replica 1 died; the sync opens a group again, and while the old group closes replica
    1's new process comes up and joins: the group opens over it too, so it has the weights
    and takes calls once this sync is over, not a step later."""
    from torchtitan_rl.controller import fleet as fleet_module

    monkeypatch.setattr(fleet_module, "WeightSync", _Group)
    monkeypatch.setattr(_Group, "closing", None)
    fleet, supervisor = _fleet(tmp_path)
    hosts = [FakeHost(starts=False) for _ in range(2)]
    meshes = Meshes(trainer=None, generators=[FakeMesh(h) for h in hosts], generator_hosts=hosts)

    async def joins():  # its new process comes up while the old group closes
        hosts[1].starts.set()
        while not fleet.replicas[1].joining:
            await asyncio.sleep(0.01)

    async def scenario():
        supervisor.install()
        await fleet.start(meshes, trainer=None, run_dir=None)
        try:
            await fleet.open_weight_sync()
            fleet.replica_down(1)  # its new process waits for its host to let it start
            _Group.closing = joins
            await _watch(supervisor, fleet.sync())
            assert fleet.replicas[1].up and not fleet.replicas[1].joining
        finally:
            await fleet.close()
            supervisor.uninstall()

    asyncio.run(scenario())
    assert fleet._members == ("generator", "generator1_r1")
    assert [r.actor.version for r in fleet.replicas] == [7, 7]


def test_a_replica_that_dies_while_the_first_weight_group_forms_is_survived(tmp_path, monkeypatch):
    """`Controller.start` with 2 replicas and a named transport: replica 1 dies while the
    first group forms. The sync is tried again over the live replica (the death is survived,
    as mid-run), not reported as a transport that could not be opened."""
    from test_resume import tiny_config

    from torchtitan_rl.controller import fleet as fleet_module
    from torchtitan_rl.controller import loop

    monkeypatch.setattr(fleet_module, "PEER_REPORT_WAIT_S", 0.3)
    config = tiny_config(
        tmp_path, "start", "--generator.num_replicas=2", "--weight_sync.transport=broadcast"
    )
    controller = loop.Controller(config, use_tqdm=False)
    fleet, opened, synced, wheres = controller.fleet, [], [], []
    hosts = [FakeHost(starts=False) for _ in range(2)]  # the restarted one stays starting

    async def launch(cfg, replicas):
        return Meshes(trainer=None, generators=[FakeMesh(h) for h in hosts], generator_hosts=hosts)

    async def no_processes(*args):
        return []

    async def open_weight_sync():
        members = tuple(r.name for r in fleet.replicas if r.up or r.joining)
        opened.append(members)
        wheres.append(controller.supervisor.where)  # what a death here is said to be during
        if len(opened) == 1:
            fleet.replica_down(1)  # as the Supervisor's report of its death would
            raise TransportUnavailable('weight_sync.transport = "broadcast" could not be '
                                       "opened (RuntimeError: a peer closed the connection)")  # fmt: skip
        fleet.weight_sync, fleet._members = FakeSync(synced), members
        fleet.weight_sync.members = members

    monkeypatch.setattr(loop, "launch", launch)
    monkeypatch.setattr(loop, "spawn_trainer", lambda *args, **kwargs: None)
    monkeypatch.setattr(loop, "record_processes", no_processes)
    fleet.open_weight_sync = open_weight_sync

    async def scenario():
        try:
            await asyncio.wait_for(controller.start(), WATCH_LIMIT_S)
        finally:
            await controller.close()

    asyncio.run(scenario())
    assert opened == [("generator", "generator1"), ("generator",)]
    assert set(wheres) == {"while giving the generators their first weights"}
    assert synced == [("generator",)] and controller.trainer_version == FakeSync.version


def test_a_regrouped_sync_opens_a_new_group_and_survives_a_death_while_it_forms(tmp_path):
    """After the warm start changed the [lora] base (`regroup`), the next sync opens a new
    group (the base goes out first) inside the sync's retries: replica 1 dying while it forms
    is survived. A sync without `regroup` keeps the group it has."""
    fleet, supervisor = _fleet(tmp_path)
    opened, synced = [], []

    async def scenario():
        await _start(fleet, restarts_start=False, synced=synced)
        try:
            await fleet.open_weight_sync()  # at start, over both replicas
            good_open = fleet.open_weight_sync

            async def open_weight_sync():
                opened.append(tuple(r.name for r in fleet.replicas if r.up or r.joining))
                if len(opened) == 1:
                    fleet.replica_down(1)  # as the Supervisor's report of its death would
                    raise TransportUnavailable('weight_sync.transport = "broadcast" could not '
                                               "be opened (RuntimeError: a peer left)")  # fmt: skip
                await good_open()
                fleet._regroup = False  # as the real one does once it opened

            fleet.open_weight_sync = open_weight_sync
            await asyncio.wait_for(fleet.sync(), WATCH_LIMIT_S)  # keeps its group
            assert opened == []
            fleet.regroup()
            await asyncio.wait_for(fleet.sync(), WATCH_LIMIT_S)
        finally:
            await fleet.close()
            supervisor.uninstall()

    asyncio.run(scenario())
    assert opened == [("generator", "generator1"), ("generator",)]
    assert synced == [("generator", "generator1"), ("generator",)]


def test_a_broken_sync_waits_for_a_host_death_report_as_long_as_the_host_timeout(
    tmp_path, monkeypatch
):
    """A whole host's death is reported after launcher.host_timeout_s (+ ~9 s): a sync that
    broke waits that long for the report, not PEER_REPORT_WAIT_S only, before taking the
    break for something else; then it goes on over the live replica."""
    from torchtitan_rl.controller import fleet as fleet_module
    from torchtitan_rl.weight_sync.broadcast import BroadcastBroken

    monkeypatch.setattr(fleet_module, "PEER_REPORT_WAIT_S", 0.1)
    monkeypatch.setattr(fleet_module, "HOST_REPORT_MARGIN_S", 0.0)
    fleet, supervisor = _fleet(tmp_path, "--launcher.host_timeout_s=5")

    async def breaks():  # the host's report comes 0.5 s after the break
        asyncio.get_running_loop().call_later(0.5, fleet.replica_down, 1)
        raise BroadcastBroken("Connection closed by peer")

    synced = _run_sync_first_broken(fleet, supervisor, breaks)
    assert synced == [("generator", "generator1"), ("generator",)]


@pytest.mark.parametrize("broadcast", ["breaks", "hangs"])
def test_a_sync_broken_by_a_replica_process_gone_on_this_host_goes_on_at_once(
    tmp_path, monkeypatch, broadcast
):
    """A replica's process on this host is killed while the weights go out: the broadcast
    breaks ("Connection closed by peer") or hangs long before Monarch reports the death
    (2-10 s). The fleet sees the process gone and goes on over the live replica, without
    that report."""
    from torchtitan_rl.controller import fleet as fleet_module
    from torchtitan_rl.weight_sync.broadcast import BroadcastBroken

    monkeypatch.setattr(fleet_module, "PEER_REPORT_WAIT_S", 0.5)
    monkeypatch.setattr(fleet_module, "HOST_REPORT_MARGIN_S", -0.5)  # 0.5 s with 1 s hosts
    fleet, supervisor = _fleet(tmp_path, "--launcher.host_timeout_s=1")
    process = _process_of_replica_1(fleet)

    async def breaks():
        process.kill()
        process.wait()
        if broadcast == "hangs":
            await asyncio.Event().wait()
        raise BroadcastBroken("Connection closed by peer")

    try:
        synced = _run_sync_first_broken(fleet, supervisor, breaks)
    finally:
        process.kill()
    assert synced == [("generator", "generator1"), ("generator",)]
    assert not fleet.replicas[1].up


def test_a_replica_process_gone_during_a_sync_under_stop_is_left_to_the_supervisor(tmp_path):
    """generator.on_replica_death = "stop": a replica's process on this host dies while the
    weights go out. The look at the processes does not mark it down (no restart, no
    MemberDied); the Supervisor's report ends the run with its line."""
    import threading

    fleet, supervisor = _fleet(tmp_path, "--generator.on_replica_death=stop")
    process = _process_of_replica_1(fleet)
    report = KILLED.replace("generator{", "generator1{")

    async def hangs():
        process.kill()
        process.wait()
        threading.Timer(0.6, supervisor._on_failure, [_Failure(report)]).start()
        await asyncio.Event().wait()

    async def scenario():
        await _start(fleet, restarts_start=False)
        try:
            supervisor.where = "during RL step 3"
            with pytest.raises(ActorFailure) as failure:
                await _sync_first_broken(fleet, supervisor, [], hangs)
            return failure.value
        finally:
            await fleet.close()
            supervisor.uninstall()
            process.kill()

    failure = asyncio.run(scenario())
    assert failure.actor == "generator1"
    assert str(failure).startswith("generator1 failed during RL step 3 (rank 0): ")
    assert all(r.incarnation == 0 for r in fleet.replicas)  # nothing restarted
