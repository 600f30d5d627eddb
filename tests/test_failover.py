"""A dead generator replica is survived: its calls go to a live replica, it restarts under a
new name, rejoins at the next weight sync, and a seeded run replays bit for bit through it."""

import asyncio
import os
import re
import signal
import threading

import numpy as np
import pytest
from test_faults import KILLED, LOGGER, _Failure

from torchtitan_rl.controller.fleet import GeneratorFleet
from torchtitan_rl.controller.replica import parse_replica_name, replica_name
from torchtitan_rl.controller.supervision import ActorFailure, Supervisor
from torchtitan_rl.rollout.router import ReplicaDown, Router
from torchtitan_rl.types import Completion, FinishReason


class Replica:
    """A replica whose process dies (its calls raise ReplicaDown) once `die` is set."""

    def __init__(self, name):
        self.name, self.calls, self.die = name, [], asyncio.Event()

    async def __call__(self, prompt_ids, *, request_id, session_id=None, sampling=None):
        self.calls.append(request_id)
        stop = asyncio.ensure_future(self.die.wait())
        await asyncio.wait({stop}, timeout=0.05)
        if self.die.is_set():
            raise ReplicaDown(self.name)
        stop.cancel()
        return Completion(
            request_id=request_id,
            token_ids_N=np.zeros(1, np.int32),
            logprobs_N=np.zeros(1, np.float32),
            finish_reason=FinishReason.STOP,
            metrics={"replica": float(self.name)},
        )


def test_calls_of_a_dead_replica_go_to_a_live_one_and_its_sessions_move():
    replicas = [Replica(0), Replica(1)]
    downs = []
    router = Router(replicas, on_down=downs.append)

    async def main():
        calls = [
            asyncio.ensure_future(
                router(np.zeros(2, np.int32), request_id=f"r{i}", session_id=f"s{i}")
            )
            for i in range(4)
        ]
        await asyncio.sleep(0.01)
        replicas[1].die.set()  # replica 1 dies with its 2 calls in flight
        done = await asyncio.gather(*calls)
        again = await router(np.zeros(2, np.int32), request_id="next", session_id="s1")
        return done, again

    done, again = asyncio.run(main())
    assert [c.metrics["replica"] for c in done] == [0.0] * 4  # every call answered, by 0
    assert downs == [1] and router.down == {1}  # told once
    assert router.rerouted == 2
    assert again.metrics["replica"] == 0.0 and router.sessions["s1"] == 0


def test_with_every_replica_down_calls_wait_until_one_is_up():
    replicas = [Replica(0), Replica(1)]
    router = Router(replicas)
    for i in (0, 1):
        router.set_down(i)

    async def main():
        call = asyncio.ensure_future(router(np.zeros(1, np.int32), request_id="a"))
        await asyncio.sleep(0.1)
        assert not call.done() and not any(r.calls for r in replicas)
        router.set_up(1)
        return await call

    assert asyncio.run(main()).metrics["replica"] == 1.0


def test_replica_names_name_the_replica_and_its_restart():
    assert [replica_name(i) for i in range(3)] == ["generator", "generator1", "generator2"]
    assert replica_name(1, 2) == "generator1_r2"
    assert parse_replica_name("generator") == (0, 0)
    assert parse_replica_name("generator1_r2") == (1, 2)
    assert parse_replica_name("trainer") is None


def _fleet(tmp_path, *overrides):
    from test_resume import tiny_config

    config = tiny_config(tmp_path, "fleet", "--generator.num_replicas=2", *overrides)
    supervisor = Supervisor(("trainer", "generator", "generator1"))
    return GeneratorFleet(config, supervisor, vocab_size=64, log_dir=tmp_path), supervisor


def test_the_supervisor_carries_on_after_a_survived_death_and_stops_on_another(tmp_path):
    """Monarch's own actor on the dead process reports first (names none of ours), then
    ours, then the logger again: all are set aside when the fleet survives the death; a
    trainer death still ends the run with its line."""
    fleet, supervisor = _fleet(tmp_path)
    survived = []
    supervisor.survive = lambda name: survived.append(name) or name.startswith("generator")
    trainer_killed = KILLED.replace("GeneratorActor generator{", "TrainerActor trainer{")

    async def scenario():
        supervisor.install()
        try:
            hung = asyncio.get_running_loop().create_future()
            threading.Timer(0.1, supervisor._on_failure, [_Failure(LOGGER)]).start()
            threading.Timer(0.2, supervisor._on_failure, [_Failure(KILLED)]).start()
            threading.Timer(1.0, supervisor._on_failure, [_Failure(LOGGER)]).start()  # echo
            threading.Timer(3.5, supervisor._on_failure, [_Failure(trainer_killed)]).start()
            with pytest.raises(ActorFailure) as failure:
                await supervisor.watch(hung)
            return failure.value
        finally:
            supervisor.uninstall()

    failure = asyncio.run(scenario())
    assert survived == ["generator", "trainer"]
    assert failure.actor == "trainer" and str(failure).startswith("trainer failed")
    assert len(supervisor.survived) == 3  # the logger's reports went with ours


def test_on_replica_death_stop_and_one_replica_leave_deaths_to_the_supervisor(tmp_path):
    assert _fleet(tmp_path)[0].survives
    assert not _fleet(tmp_path, "--generator.on_replica_death=stop")[0].survives
    from test_resume import tiny_config

    one = tiny_config(tmp_path, "one")
    assert not GeneratorFleet(
        one, Supervisor(("trainer",)), vocab_size=64, log_dir=tmp_path
    ).survives
    with pytest.raises(ValueError, match="generator.on_replica_death must be one of"):
        tiny_config(tmp_path, "bad", "--generator.on_replica_death=retry")


# ---- a real death -------------------------------------------------------------------------
FAILOVER = (
    "--generator.num_replicas=2",
    "--rollout.max_staleness=1",
    "--parallelism.trainer_procs=1",
    "--rollout.prompts_per_step=8",
    "--training.steps=6",
    "--validation.interval=0",
)
CLOCK_TAGS = ("seconds", "per_second", "_ms", "perf/", "steps_to_first_token", "memory",
              "generator/engine_", "generator/routed_")  # fmt: skip


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def _serving(fleet, index: int) -> bool:
    """Whether replica `index` has calls in flight: the controller's, or (rollout.processes)
    a rollout process's."""
    if fleet.replicas[index].fn.in_flight:
        return True
    if fleet.rollout is None:
        return False
    counts = await asyncio.gather(*(a.routed.call_one() for a in fleet.rollout.actors))
    return any(c["in_flight"][index] for c in counts)


def _run(config, kill_at_step=None):
    """Run to the end; with `kill_at_step`, SIGKILL replica 1's process while it serves
    requests of that RL step. Returns (scalars per tag, the fleet)."""
    from torchtitan_rl.controller.loop import Controller

    controller = Controller(config, use_tqdm=False)

    async def kill():
        fleet = controller.fleet
        while len(fleet.replicas) < 2 or controller.supervisor.where != (
            f"during RL step {kill_at_step}"
        ):
            await asyncio.sleep(0.005)
        pid = await fleet.replicas[1].actor.pid.call_one()
        while not await _serving(fleet, 1):
            await asyncio.sleep(0.001)
        os.kill(pid, signal.SIGKILL)
        return pid

    sync = controller.fleet.sync

    async def sync_once_restarted():
        """Step kill_at_step + 2's sync waits for the restart (seconds on a busy VM) so
        that the replica rejoins within the run."""
        if controller.supervisor.where == f"during RL step {kill_at_step + 2}":
            replica = controller.fleet.replicas[1]
            await asyncio.wait_for(_until(lambda: replica.joining or replica.up), 300)
        return await sync()

    if kill_at_step:
        controller.fleet.sync = sync_once_restarted

    async def go():
        killer = asyncio.ensure_future(kill()) if kill_at_step else None
        try:
            await controller.run()
        finally:
            await controller.close()
        return await killer if killer else None

    pid = asyncio.run(go())
    history = {tag: dict(series) for tag, series in controller.metrics.history.items()}
    return history, controller.fleet, pid


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run no replica dies in, played on the controller's loop: the reference of both
    cases (2 rollout processes play the same run bit for bit: test_rollout_processes.py)."""
    from test_resume import tiny_config

    tmp = tmp_path_factory.mktemp("failover")
    return _run(tiny_config(tmp, "straight", *FAILOVER, "--rollout.processes=0"))[0]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [0, 2])
def test_a_replica_killed_mid_step_is_survived_and_the_run_replays_bit_for_bit(
    tmp_path, processes, straight
):
    """Also with the rollouts played in 2 rollout processes, which call the replicas
    themselves and are told of the death and the rejoin by the fleet."""
    from test_resume import tiny_config

    from torchtitan_rl.controller.processes import started

    flags = (*FAILOVER, f"--rollout.processes={processes}")
    killed, fleet, pid = _run(tiny_config(tmp_path, "killed", *flags), kill_at_step=2)
    assert sum(killed["generator/requests_rerouted"].values()) >= 1
    assert min(killed["generator/replicas_alive"].values()) == 1.0  # down after step 2
    assert killed["generator/replicas_alive"][4] == 2.0  # restarted, rejoined at step 4's sync
    assert straight["generator/replicas_alive"] == {s: 2.0 for s in range(1, 7)}
    # the rejoined replica takes calls again (with processes: they were told it is up)
    assert killed["generator/routed_calls_max_over_mean"][5] < 2.0  # (step 6's batch came
    # before step 5's report: no call is reported at step 6)
    tags = [t for t in straight if not any(c in t for c in CLOCK_TAGS)]
    tags = [t for t in tags if not t.startswith("generator/")]
    assert {"rollout_reward/mean", "loss/mean", "trainer/grad_norm"} <= set(tags)
    for tag in tags:
        assert straight[tag] == killed[tag], tag
    assert fleet.replicas[1].name == "generator1_r1"
    assert started(pid) is None  # nothing left running: the killed process is gone...
    assert all(started(w["pid"]) != t for w, t in fleet.local_processes)  # ...its successor too


def test_two_requests_rerouted_through_two_deaths_count_once_each_and_wait_for_a_replica():
    replicas = [Replica(0), Replica(1)]

    def on_down(index):
        raise RuntimeError("the owner's trouble")  # logged; the call is still moved

    router = Router(replicas, on_down=on_down)

    async def main():
        calls = [
            asyncio.ensure_future(router(np.zeros(1, np.int32), request_id=f"r{i}"))
            for i in range(2)
        ]
        await asyncio.sleep(0.01)
        for replica in replicas:
            replica.die.set()
        await asyncio.sleep(0.1)
        assert router.down == {0, 1} and not any(c.done() for c in calls)
        router.replicas[1] = Replica(1)  # restarted
        router.set_up(1)
        return await asyncio.gather(*calls)

    done = asyncio.run(main())
    assert [c.metrics["replica"] for c in done] == [1.0, 1.0]
    assert router.rerouted == 2  # requests, not attempts


def test_replicas_restarted_while_none_is_up_get_weights_and_take_calls(tmp_path, caplog):
    """No step can end (it waits on generation) to sync them in, so the fleet syncs them
    itself once restarted."""
    import contextvars

    from torchtitan_rl.actors.generate_fn import ActorGenerateFn
    from torchtitan_rl.controller.replica import Replica as FleetReplica

    fleet, supervisor = _fleet(tmp_path)

    class Actor:
        def __init__(self, name):
            self.name = name

    async def respawn(replica, name):  # stands in for a new process
        await asyncio.sleep(0.01)
        return Actor(name)

    synced = []

    class Sync:
        version = 5

        async def __call__(self):
            synced.append(fleet._members)

    async def open_weight_sync():
        fleet.weight_sync = Sync()
        fleet._members = tuple(r.name for r in fleet.replicas if r.up or r.joining)

    fleet._respawn, fleet.open_weight_sync = respawn, open_weight_sync
    for i in range(2):
        actor = Actor(replica_name(i))
        fn = ActorGenerateFn(actor, replica_name(i), failover=True)
        fleet.replicas.append(FleetReplica(index=i, name=replica_name(i), actor=actor, fn=fn))
    fleet.router = Router([r.fn for r in fleet.replicas], on_down=fleet.replica_down)

    async def main():
        supervisor.install()
        fleet._context = contextvars.copy_context()
        fleet.replica_down(0)
        fleet.replica_down(1)
        await asyncio.wait_for(_until(lambda: all(r.up or r.joining for r in fleet.replicas)), 10)
        await asyncio.sleep(0.05)
        supervisor.uninstall()

    asyncio.run(main())
    # the first one back is synced at once and takes calls; the second joins with it if it
    # came back before the first was up, else waits for the step's sync like any restart
    assert fleet.version == 5 and synced[0] == ("generator_r1",)
    assert fleet.replicas[0].up and fleet.router.down <= {1}
    assert fleet.replicas[1].up or fleet.replicas[1].joining
    rejoined = [r.getMessage() for r in caplog.records if "rejoined" in r.getMessage()]
    assert re.fullmatch(r"generator_r1 rejoined after \d+ s, at policy version 5", rejoined[0])


def test_a_stopped_run_takes_the_weight_sync_in_flight_with_it(tmp_path):
    """SIGTERM cancels the step: the sync in flight is cancelled too, not left to fail later
    with a report of the stopped processes."""
    fleet, _ = _fleet(tmp_path)
    state = {}

    async def sync():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            state["sync"] = "cancelled"
            raise

    async def main():
        step = asyncio.ensure_future(fleet._unless_a_member_dies(sync()))
        await asyncio.sleep(0.05)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert state == {"sync": "cancelled"}
