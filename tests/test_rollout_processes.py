"""rollout.processes: the step's groups played in rollout processes that call the generator
replicas themselves (actors/rollout.py, controller/rollout_processes.py)."""

import asyncio
from multiprocessing import active_children

import numpy as np
import pytest
from test_failover import CLOCK_TAGS, _fleet
from test_failover import Replica as FakeGenerateFn
from test_fleet_metrics import _Actor, _replicas

from torchtitan_rl.config import ConfigError, load_config
from torchtitan_rl.controller.rollout_processes import RolloutProcesses, process_names
from torchtitan_rl.rollout.records import rollout_record
from torchtitan_rl.rollout.router import Router

SHAPE = (
    "--generator.num_replicas=2",
    "--generator.batch_invariant=true",
    "--parallelism.trainer_procs=1",
    "--rollout.prompts_per_step=4",
    "--training.steps=3",
    "--checkpoint.interval=0",
)


def _validation_records(step, groups) -> list[dict]:
    """Every validation rollout of `groups` as its record, with its tokens and log-probs."""
    out = []
    for group in groups:
        for rollout in group.rollouts:
            record = rollout_record(rollout, step=step, pick="validation", group=group)
            record["tokens"] = [t.completion.token_ids_N.tolist() for t in rollout.turns]
            record["logprobs"] = [t.completion.logprobs_N.tobytes() for t in rollout.turns]
            out.append(record)
    return out


def _run(config):
    """Run to the end; returns what the run logged and saw: scalars per tag, each rollout
    process's routing counters and the controller's env worker processes alive (both read
    before the run closed), the controller's router's calls, the validation rollouts'
    records in the order they were played."""
    from torchtitan_rl.controller.loop import Controller

    controller = Controller(config, use_tqdm=False)
    ran = {"counters": [], "validation": []}
    report = controller.diagnostics.report

    def report_and_record(step, groups, *, training=True):
        if not training:
            ran["validation"].extend(_validation_records(step, groups))
        report(step, groups, training=training)

    controller.diagnostics.report = report_and_record

    async def go():
        try:
            await controller.run()
            if controller.fleet.rollout is not None:
                for actor in controller.fleet.rollout.actors:
                    ran["counters"].append(await actor.routed.call_one())
            ran["env_workers"] = [p for p in active_children() if p.name == "env-worker"]
            ran["router_calls"] = list(controller.fleet.router.routed)
        finally:
            await controller.close()

    asyncio.run(go())
    ran["scalars"] = {tag: dict(s) for tag, s in controller.metrics.history.items()}
    return ran


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run played on the controller's loop and in 2 rollout processes, both with
    env.workers=1 (each process's env work in its own worker pool)."""
    from test_resume import tiny_config

    tmp = tmp_path_factory.mktemp("rollout_processes")
    loop = _run(tiny_config(tmp, "loop", *SHAPE, "--env.workers=1"))
    procs = _run(tiny_config(tmp, "procs", *SHAPE, "--env.workers=1", "--rollout.processes=2"))
    return loop, procs


@pytest.mark.slow
def test_groups_played_in_two_processes_train_the_same_run_bit_for_bit(runs):
    loop, procs = runs
    on_loop, in_procs, counters = loop["scalars"], procs["scalars"], procs["counters"]
    assert loop["counters"] == []
    # each process played its share and sent turns to both replicas
    assert len(counters) == 2 and all(min(c["calls"]) > 0 for c in counters)
    assert all(c["in_flight"] == [0, 0] for c in counters)  # nothing left waiting
    # ...and the controller reports their routing as the router's
    assert in_procs["generator/routed_calls_max_over_mean"]
    tags = [t for t in on_loop if not any(c in t for c in CLOCK_TAGS)]
    tags = [t for t in tags if not t.startswith("generator/")]  # how the engines were fed
    assert {"rollout_reward/mean", "loss/mean", "trainer/grad_norm"} <= set(tags)
    for tag in tags:
        assert on_loop[tag] == in_procs[tag], tag
    # validation (after steps 0 and 3) played its samples in the processes, not on the
    # loop: the same rollouts, token for token, and the same validation_reward/* scalars
    assert sum(loop["router_calls"]) > 0 and procs["router_calls"] == [0, 0]
    assert len(loop["validation"]) == 2 * 4
    assert loop["validation"] == procs["validation"]
    assert sorted(on_loop["validation_reward/mean"]) == [0, 3]
    assert [t for t in tags if t.startswith("validation_reward/")] == [
        t for t in in_procs if t.startswith("validation_reward/")
    ]


@pytest.mark.slow
def test_with_rollout_processes_the_controller_starts_no_env_workers_of_its_own(runs):
    """Validation played on the controller started its env.workers pool beside each rollout
    process's: (K + 1) x N worker processes, and env work on the controller's loop."""
    loop, procs = runs
    assert len(loop["env_workers"]) == 1  # seen where the controller plays (validation too)
    assert sorted(procs["scalars"]["validation_reward/mean"]) == [0, 3]
    assert procs["env_workers"] == []
    assert procs["router_calls"] == [0, 0]  # the controller's router: no validation call


def test_the_rollout_processes_routing_is_reported_with_the_routers(tmp_path):
    fleet, _ = _fleet(tmp_path)
    _replicas(fleet, _Actor(), _Actor())
    fleet.router = Router([FakeGenerateFn(0), FakeGenerateFn(1)])
    asyncio.run(fleet.router(np.zeros(3, np.int32), request_id="own"))  # replica 0
    out = fleet.metrics(([1, 5], [10, 50], 2))  # the processes: 1 and 5 calls, 2 rerouted
    assert out["generator/routed_calls_max_over_mean"] == 5 * 2 / 7
    # replica 0: the controller's own call (3 prompt + 64 max_tokens) and the processes' 10
    assert out["generator/routed_tokens_max_over_mean"] == (10 + 67) * 2 / (10 + 67 + 50)
    assert out["generator/requests_rerouted"] == 2.0
    out = fleet.metrics(([1, 7], [10, 70], 3))  # counters since start: 2 more calls, 1 more
    assert out["generator/routed_calls_max_over_mean"] == 2.0
    assert out["generator/requests_rerouted"] == 1.0


class _Endpoint:
    def __init__(self, log, name, answer=None):
        self.log, self.name, self.answer = log, name, answer

    async def call_one(self, *args):
        self.log.append((self.name, args))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


class _RolloutActor:
    def __init__(self, log, routed):
        for name in ("replica_down", "replica_up", "play_group", "close"):
            setattr(self, name, _Endpoint(log, name, answer=name))
        self.routed = _Endpoint(log, "routed", answer=routed)


def test_groups_go_round_robin_deaths_reach_every_process_and_counters_add_up(tmp_path):
    fleet, _ = _fleet(tmp_path, "--rollout.processes=2")
    logs = [[], []]
    procs = RolloutProcesses(fleet.config, tmp_path)
    procs.actors = [
        _RolloutActor(logs[0], {"calls": [1, 2], "tokens": [10, 20], "rerouted": 1}),
        _RolloutActor(logs[1], RuntimeError("gone")),  # a process that does not answer
    ]
    assert procs.names == process_names(2) == ("rollout0", "rollout1")

    async def go():
        played = [await procs.play_group({"s": g}, group_id=g, step=4) for g in (0, 1, 2)]
        procs.replica_down(1)
        procs.replica_up(1, "actor", "generator1_r1")
        await asyncio.sleep(0)  # the tells are not awaited by the fleet
        return played, await procs.routed()

    played, routed = asyncio.run(go())
    assert played == ["play_group"] * 3
    assert [args for name, args in logs[0] if name == "play_group"] == [
        ({"s": 0}, 0, 4), ({"s": 2}, 2, 4)
    ]  # fmt: skip
    assert [args for name, args in logs[1] if name == "play_group"] == [({"s": 1}, 1, 4)]
    for log in logs:
        assert [(n, a) for n, a in log if n.startswith("replica_")] == [
            ("replica_down", (1,)), ("replica_up", (1, "actor", "generator1_r1"))
        ]  # fmt: skip
    assert routed == ([1, 2], [10, 20], 1)  # the silent process is left out


def test_a_process_silent_once_counts_with_its_last_answer_so_no_count_goes_back(tmp_path):
    """A process that does not answer `routed` in time (its loop busy) at one step: the
    sums keep its last counters; dropping it made requests_rerouted negative at that step
    and count its old reroutes again at the next."""
    fleet, _ = _fleet(tmp_path, "--rollout.processes=2")
    _replicas(fleet, _Actor(), _Actor())
    fleet.router = Router([FakeGenerateFn(0), FakeGenerateFn(1)])
    procs = RolloutProcesses(fleet.config, tmp_path)
    counters = {"calls": [10, 10], "tokens": [100, 100], "rerouted": 3}
    procs.actors = [_RolloutActor([], counters), _RolloutActor([], counters)]
    silent = procs.actors[1].routed

    async def steps():
        reports = [fleet.metrics(await procs.routed())]
        silent.answer = RuntimeError("timed out")
        reports.append(fleet.metrics(await procs.routed()))
        silent.answer = {"calls": [12, 11], "tokens": [120, 110], "rerouted": 3}
        reports.append(fleet.metrics(await procs.routed()))
        return [r["generator/requests_rerouted"] for r in reports], reports[2]

    rerouted, last = asyncio.run(steps())
    assert rerouted == [6.0, 0.0, 0.0]
    assert last["generator/routed_calls_max_over_mean"] == 2 * 2 / 3  # the 3 calls since


def test_the_death_line_says_the_rollout_processes_requests_move_too(tmp_path, caplog):
    """With rollout processes the controller's own calls are few (validation): its count
    alone said "0 request(s) in flight" while the processes moved theirs."""
    from torchtitan_rl.actors.generate_fn import ActorGenerateFn
    from torchtitan_rl.controller.replica import Replica as FleetReplica

    fleet, _ = _fleet(tmp_path, "--rollout.processes=2")
    for i in range(2):
        fn = ActorGenerateFn(_Actor(), f"generator{i}", failover=True)
        fleet.replicas.append(FleetReplica(index=i, name=f"generator{i}", actor=None, fn=fn))
    logs = [[], []]
    fleet.rollout = RolloutProcesses(fleet.config, tmp_path)
    fleet.rollout.actors = [_RolloutActor(log, {}) for log in logs]

    async def restart(replica):
        pass

    async def death():
        fleet._restart = restart
        fleet.replica_down(1)
        await asyncio.sleep(0)  # the tells

    with caplog.at_level("WARNING", logger="torchtitan_rl.controller.fleet"):
        asyncio.run(death())
    assert [m for m in caplog.messages if "died" in m] == [
        "generator1 died; 0 request(s) in flight (and the rollout processes' requests "
        "there) go to the 1 live replica(s); restarting it"
    ]
    assert logs == [[("replica_down", (1,))]] * 2


def test_a_negative_number_of_processes_is_one_line_naming_the_key(tmp_path):
    from test_resume import ROOT

    with pytest.raises((ConfigError, ValueError), match=r"rollout\.processes"):
        load_config(
            ROOT / "train_configs" / "alphabet_sort_tiny.toml", ["--rollout.processes=-1"]
        ).validate()


class _SlowEndpoint(_Endpoint):
    """Arrives `delay` seconds after it is sent (another sender's path through Monarch)."""

    def __init__(self, log, name, delay):
        super().__init__(log, name)
        self.delay = delay

    async def call_one(self, *args):
        await asyncio.sleep(self.delay)
        return await super().call_one(*args)


def test_each_process_hears_a_death_and_a_rejoin_in_the_order_they_were_told(tmp_path):
    fleet, _ = _fleet(tmp_path, "--rollout.processes=2")
    logs = [[], []]
    procs = RolloutProcesses(fleet.config, tmp_path)
    procs.actors = [_RolloutActor(log, {}) for log in logs]
    for log, actor in zip(logs, procs.actors):
        actor.replica_down = _SlowEndpoint(log, "replica_down", delay=0.05)  # slow to arrive

    async def go():
        procs.replica_down(1)
        procs.replica_up(1, "actor", "generator1_r1")
        await asyncio.gather(*procs._tasks)

    asyncio.run(go())
    for log in logs:
        assert [name for name, _ in log] == ["replica_down", "replica_up"]
