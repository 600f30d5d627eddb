"""A dead trainer or generator process ends the run with one clear line, never a hang."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from fakes import run_until_a_kill_ends_it
from monarch.actor import Actor, endpoint

from torchtitan_rl.controller.checkpoints import CheckpointStore
from torchtitan_rl.controller.loop import Controller
from torchtitan_rl.controller.supervision import (
    ActorFailure,
    SupervisionError,
    Supervisor,
    describe_failure,
)

KILLED = (
    "The actor <root>.<torchtitan_rl.actors.generator.GeneratorActor generator{'procs': 0/1}> "
    "and all its descendants have failed:\n"
    "  the process this actor was running on failed: Killed(sig=9)"
)
QUERIED = (
    "timeout waiting for message from proc mesh agent while querying for "
    '"generator-AFvLhU7V2c2". The process likely crashed'
)
LOGGER = (
    "The actor logger-tTVtQ3vHas1{'procs': 1/2} and all its descendants have failed:\n"
    "  the process this actor was running on exited with non-zero code 5"
)
INIT = (
    "Endpoint call trainer.pid() failed, The actor <root>.<torchtitan_rl.actors.trainer."
    "TrainerActor trainer{'gpus': 1/2}> and all its descendants have failed:\n"
    "  actor explicitly aborted due to: Traceback (most recent call last):\n"
    '    File "x.py", line 7, in __init__\n'
    "  ValueError: model.hf_checkpoint: tensor 'norm.weight' has shape (3,)\n"
)


def test_failure_line_names_actor_rank_stage_and_reason():
    names = ("trainer", "generator")
    assert describe_failure(KILLED, names, "during RL step 3") == (
        "generator failed during RL step 3 (rank 0): "
        "the process this actor was running on failed: Killed(sig=9)"
    )
    assert describe_failure(INIT, names, "at start-up") == (
        "trainer failed at start-up (rank 1): "
        "ValueError: model.hf_checkpoint: tensor 'norm.weight' has shape (3,)"
    )
    assert describe_failure(LOGGER, names, "x").startswith("an actor failed x")
    # a call that timed out on a crashed process names the actor's mesh only: no rank
    assert describe_failure(QUERIED, names, "during RL step 3") == (
        "generator failed during RL step 3: timeout waiting for message from proc mesh agent "
        'while querying for "generator-AFvLhU7V2c2". The process likely crashed'
    )


class _Failure:
    def __init__(self, text):
        self.text = text

    def report(self):
        return self.text


def test_a_failure_report_ends_a_hung_await_within_the_grace_period():
    supervisor = Supervisor(("trainer", "generator"))

    async def scenario():
        supervisor.install()
        try:
            supervisor.where = "during RL step 7"
            loop = asyncio.get_running_loop()
            hung = loop.create_future()  # an endpoint call that never returns
            for report in (LOGGER, KILLED):  # Monarch reports on its own thread
                threading.Timer(0.2, supervisor._on_failure, [_Failure(report)]).start()
            t0 = time.perf_counter()
            with pytest.raises(ActorFailure, match="generator failed during RL step 7"):
                await supervisor.watch(hung)
            assert hung.cancelled()
            return time.perf_counter() - t0
        finally:
            supervisor.uninstall()

    assert asyncio.run(scenario()) < 5


@pytest.mark.parametrize("survived", [False, True])
def test_a_death_reported_while_the_awaited_call_finishes_still_ends_it(survived):
    """A validation's calls on a dead generator fail at once and it finishes (its lost
    rollouts scored) just after the report: the death still ends the run with its line
    (generator.on_replica_death = "stop", one replica), unless the fleet survives it."""
    supervisor = Supervisor(("trainer", "generator"))
    supervisor.survive = lambda name: survived

    async def validation():
        while not supervisor.reports and not supervisor.survived:
            await asyncio.sleep(0.01)
        return "validated"

    async def scenario():
        supervisor.install()
        try:
            supervisor.where = "while validating after RL step 8"
            threading.Timer(0.1, supervisor._on_failure, [_Failure(KILLED)]).start()
            return await supervisor.watch(validation())
        finally:
            supervisor.uninstall()

    if survived:
        assert asyncio.run(scenario()) == "validated"
    else:
        with pytest.raises(ActorFailure, match="generator failed while validating after RL step 8"):
            asyncio.run(scenario())


@pytest.mark.parametrize("route", ["report", "endpoint error"])
def test_a_death_first_reported_by_monarchs_own_actor_is_named_by_ours(route):
    """Monarch's logger on the dead process can report before our actor does (seen in CI:
    "an actor failed ..."); the line waits for the report that names ours."""
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

    supervisor = Supervisor(("trainer", "generator"))

    async def scenario():
        supervisor.install()
        try:
            supervisor.where = "during RL step 3"
            loop = asyncio.get_running_loop()
            call = loop.create_future()
            threading.Timer(0.1, supervisor._on_failure, [_Failure(LOGGER)]).start()
            if route == "endpoint error":  # the awaited call fails naming only the logger
                loop.call_later(0.2, call.set_exception, SupervisionError(LOGGER))
            # ours reports after the grace period the awaited call gets
            threading.Timer(3.0, supervisor._on_failure, [_Failure(KILLED)]).start()
            with pytest.raises(ActorFailure) as failure:
                await supervisor.watch(call)
            return failure.value
        finally:
            supervisor.uninstall()

    failure = asyncio.run(scenario())
    assert str(failure).startswith("generator failed during RL step 3 (rank 0)")
    assert failure.actor == "generator"


def test_with_no_report_naming_ours_the_line_says_an_actor(monkeypatch):
    from torchtitan_rl.controller import supervision

    monkeypatch.setattr(supervision, "NAMED_REPORT_WAIT_S", 0.5)
    supervisor = Supervisor(("trainer", "generator"))

    async def scenario():
        supervisor.install()
        try:
            hung = asyncio.get_running_loop().create_future()
            threading.Timer(0.1, supervisor._on_failure, [_Failure(LOGGER)]).start()
            with pytest.raises(ActorFailure, match="^an actor failed at start-up: ") as failure:
                await supervisor.watch(hung)
            return failure.value
        finally:
            supervisor.uninstall()

    assert asyncio.run(scenario()).actor is None


def test_a_report_after_the_run_closed_is_logged_not_raised(caplog):
    """A dead process's per-proc actors report ~10 s after it: by then the run may have
    closed, and Monarch's default hook would interrupt the main thread (seen in CI)."""
    import logging

    import monarch.actor

    supervisor = Supervisor(("trainer", "generator"))

    async def scenario():
        supervisor.install()
        supervisor.uninstall()

    asyncio.run(scenario())
    with caplog.at_level(logging.DEBUG, logger="torchtitan_rl"):
        monarch.actor.unhandled_fault_hook(_Failure(LOGGER))  # returns: handled
    assert "a process of a closed run reported late" in caplog.text


@pytest.mark.slow
def test_killed_generator_ends_the_run_with_a_clear_error(tmp_path):
    from test_resume import tiny_config

    config = tiny_config(tmp_path, "faulty", "--training.steps=50")
    controller = Controller(config, use_tqdm=False)

    async def kill_after_first_checkpoint():
        store = CheckpointStore(controller.run_dir, keep_latest=2)
        while store.latest() is None:
            await asyncio.sleep(0.2)
        pid = await controller.fleet.actors[0].pid.call_one()
        os.kill(pid, signal.SIGKILL)
        return time.perf_counter()

    message, seconds = asyncio.run(
        run_until_a_kill_ends_it(controller, kill_after_first_checkpoint)
    )
    assert message.startswith("generator failed during RL step") and "\n" not in message
    assert "Killed(sig=9)" in message
    assert seconds < 30, f"noticed {seconds:.0f} s after the kill"
    # the last complete checkpoint still loads (here into one process: DCP reshards)
    from torchtitan_rl.models.tokenizer import Tokenizer
    from torchtitan_rl.training.checkpoint import load_trainer_state
    from torchtitan_rl.training.trainer import TrainerCore

    latest = CheckpointStore(controller.run_dir, keep_latest=2).latest()
    core = TrainerCore(
        model_config=config.model,
        training=config.training,
        loss=config.loss,
        correction=config.correction,
        vocab_size=Tokenizer.from_file(None).vocab_size,
        device=torch.device("cpu"),
        seed=1,
    )
    rl_updates = int(latest.name.split("_")[1]) * config.training.minibatches
    assert load_trainer_state(core, latest / "trainer") == rl_updates + 2  # + 2 warm-start steps


ROOT = Path(__file__).resolve().parents[1]


def _cli(args, tmp_path, code=None):
    """Run the entry point (as run_train.sh does) or `code` (python -c); (rc, stderr lines)."""
    argv = ["-c", code] if code else ["-m", "torchtitan_rl.train"]
    run = subprocess.run(
        [sys.executable, *argv, f"--job.output_dir={tmp_path}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return run.returncode, [line for line in run.stderr.splitlines() if line.strip()]


def test_cli_rows_longer_than_the_model_is_one_line(tmp_path):
    rc, lines = _cli(["--batcher.seq_len=4096"], tmp_path)
    assert rc == 2 and len(lines) == 1
    assert "batcher.seq_len=4096" in lines[0] and "model.max_seq_len" in lines[0]


def test_cli_debug_shows_the_traceback(tmp_path):
    rc, lines = _cli(["--debug", "--batcher.seq_len=4096"], tmp_path)
    assert rc == 2 and any("Traceback" in line for line in lines)


def test_cli_env_that_fails_to_import_is_one_line(tmp_path):
    code = (
        "import sys; sys.modules['torchtitan_rl.envs.alphabet_sort'] = None\n"
        "from torchtitan_rl.train import main; sys.exit(main(sys.argv[1:]))"
    )
    rc, lines = _cli([], tmp_path, code=code)
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: importing torchtitan_rl failed: ")
    assert "alphabet_sort" in lines[0]


def test_cli_without_a_dependency_says_which_python_lacks_it(tmp_path):
    code = (
        "import sys; sys.modules['tomli'] = None\n"
        "from torchtitan_rl.train import main; sys.exit(main(sys.argv[1:]))"
    )
    rc, lines = _cli([], tmp_path, code=code)
    assert rc == 1 and lines == [
        f"error: 'tomli' is not installed for {sys.executable}: run from the environment you "
        "installed torchtitan_rl into (pip install -e .)"
    ]


@pytest.mark.slow
def test_cli_prompt_over_the_token_budget_ends_with_one_line(tmp_path):
    rc, lines = _cli(
        ["--env.max_rollout_tokens=8", "--warm_start.steps=0", "--validation.interval=0"], tmp_path
    )
    assert rc == 1
    assert not any("Traceback" in line for line in lines), lines
    assert lines[-1].startswith("error: ValueError: env.max_rollout_tokens=8"), lines


def test_a_process_killed_by_a_signal_leaves_its_stacks_and_the_error_names_them(tmp_path):
    code = (
        "import os, sys; from torchtitan_rl.actors.fault_log import enable_fault_log\n"
        f"f = enable_fault_log({str(tmp_path)!r}, 'generator', 0)\n"
        "def deep(): os.abort()\n"
        "deep()"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=60)
    assert run.returncode != 0
    stacks = (tmp_path / "generator-rank0.log").read_text()
    assert "Fatal Python error: Aborted" in stacks and "in deep" in stacks
    supervisor = Supervisor(("trainer", "generator"), tmp_path)
    supervisor.where = "during RL step 117"
    line = str(supervisor.translate(SupervisionError(KILLED)))
    assert line.startswith("generator failed during RL step 117 (rank 0): ")
    assert line.endswith(f"; its Python stacks at death: {tmp_path / 'generator-rank0.log'}")


def test_a_run_closes_after_the_report_of_a_death_it_heard_of_first(monkeypatch):
    """The fleet hears of a replica's death before Monarch reports it (its process seen
    gone): the run's close waits for that report, which would otherwise reach the next run
    of this process; a death with no report is waited for SETTLE_S at most."""
    from torchtitan_rl.controller import supervision

    monkeypatch.setattr(supervision, "SETTLE_MARGIN_S", 0.05)
    monkeypatch.setattr(supervision, "SETTLE_S", 0.5)
    report = KILLED.replace("generator{", "generator1{")
    supervisor = Supervisor(("generator", "generator1"))
    supervisor.survive = lambda name: True

    async def scenario():
        supervisor.install()
        supervisor.own(_Mesh("generator-Fake0000001"))
        supervisor.own(_Mesh("generator1-Fake000001"))
        await asyncio.sleep(0)  # their names are known
        supervisor.survived_death("generator1")
        threading.Timer(0.3, supervisor._on_failure, [_Failure(report)]).start()
        await supervisor.settle()
        reported = list(supervisor.survived)
        supervisor.survived_death("generator")  # never reported
        t0 = time.monotonic()
        await supervisor.settle()
        supervisor.uninstall()
        return reported, time.monotonic() - t0

    reported, waited = asyncio.run(scenario())
    assert reported == [report]  # it came to this run, not after its close
    assert waited < 5.0  # bounded by SETTLE_S (0.5 s here), not hung


class _Mesh:
    """An actor mesh as `Supervisor.own` sees it: Monarch's name for it, awaited."""

    def __init__(self, name: str):
        self.name = name

    @property
    def _name(self):
        async def name():
            return self.name

        return name()


def test_a_close_does_not_wait_for_reports_of_actors_monarch_never_spawned(monkeypatch):
    """A death the fleet heard of, of an actor that is no Monarch mesh of this run (a fake
    in tests: Monarch reports nothing of it): the close does not wait SETTLE_S for it."""
    from torchtitan_rl.controller import supervision

    monkeypatch.setattr(supervision, "SETTLE_S", 3600.0)
    supervisor = Supervisor(("generator", "generator1"))

    async def scenario():
        supervisor.install()
        supervisor.own(object())  # a fake replica: it has no mesh name
        supervisor.survived_death("generator1")
        settling = asyncio.ensure_future(supervisor.settle())
        for _ in range(5):
            await asyncio.sleep(0)
        done = settling.done()
        settling.cancel()
        supervisor.uninstall()
        return done

    assert asyncio.run(scenario())


class _StartsSlowly(Actor):
    """An actor still in its constructor when its mesh is stopped: Monarch reports it
    ("cleanup error: deadline has elapsed") seconds after the stop returned."""

    def __init__(self):
        time.sleep(30)

    @endpoint
    async def ping(self) -> int:
        return 1


def test_a_late_report_of_an_earlier_runs_mesh_does_not_reach_the_next_run(caplog, monkeypatch):
    """Two runs in one process (tests, benches): run 1 stops a replica's mesh while its
    actor is still starting and closes; Monarch's report of that mesh comes after run 2 has
    begun, naming "generator" as run 2's replica is named. It goes to the debug log as a
    closed run's, and run 2 sees no failure."""
    import logging

    from monarch.actor import this_host

    here = str(Path(__file__).parent)  # the new process imports this module for the class
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    first, second = Supervisor(("generator",)), Supervisor(("generator",))

    async def scenario():
        first.install()
        mesh = this_host().spawn_procs(per_host={"procs": 1})
        first.own(mesh.spawn("generator", _StartsSlowly))
        await asyncio.sleep(1.0)  # its name is known; its constructor still runs
        try:  # the run closes before the stop is done, as its close's bounded stops may
            await asyncio.wait_for(mesh.stop(), timeout=0.5)
        except Exception:
            pass
        first.uninstall()
        second.install()
        deadline = time.monotonic() + 20
        while "reported late" not in caplog.text and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # a report handed to run 2 would be sorted by now
        second.uninstall()

    with caplog.at_level(logging.DEBUG, logger="torchtitan_rl"):
        asyncio.run(scenario())
    assert "a process of a closed run reported late" in caplog.text, first.reports
    assert second.reports == [] and second.fatal is None
