"""env.workers: what crosses to the worker processes and back by pickle (rollout/
env_workers.py). A renderer or rubric that does not pickle is one line naming the key; one a
worker cannot load stops the batch with one line; an env that does not pickle, either way,
errors its own rollouts only, and its worker serves on."""

import logging
import math
import multiprocessing

import pytest
from fakes import FakeRenderer, ScriptedGenerate
from pool_envs import PLANS, KeepsALambdaEnvironment, PlanEnvironment
from test_env_workers import collect, rollouter_for

from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.types import RolloutStatus


def test_an_unpicklable_renderer_is_one_line_naming_the_key():
    env_config = EnvConfig(workers=2)
    renderer = FakeRenderer()
    renderer.hook = lambda: 0  # a lambda does not pickle
    with pytest.raises(ValueError, match=r"^env.workers=2 tokenizes each turn in worker process"):
        rollouter_for(PlanEnvironment(env_config, seed=0), env_config, renderer)


def test_an_unpicklable_rubric_is_one_line_naming_the_key():
    from fakes import FakeEnvironment, ScriptedEnv, done

    env_config = EnvConfig(workers=2)
    environment = FakeEnvironment(lambda s: ScriptedEnv([done()]), lambda r: 1.0)
    with pytest.raises(ValueError, match=r"env.workers=2 runs the rubric in worker processes"):
        rollouter_for(environment, env_config)


def test_an_unpicklable_env_errors_its_rollouts():
    from fakes import ScriptedEnv, done

    env_config = EnvConfig(workers=1)
    environment = PlanEnvironment(env_config, seed=0)
    environment.make_env = lambda s: ScriptedEnv([done()], init_error=lambda: 0)  # a lambda
    rollouter = rollouter_for(environment, env_config, prompts_per_step=1)
    rollouts = collect(rollouter, ScriptedGenerate(lambda c: "ok"), [0])[0].rollouts
    assert all(r.status is RolloutStatus.ERROR_ENV for r in rollouts)
    assert "env.workers=1 sends ScriptedEnv to a worker process" in rollouts[0].error
    assert math.isfinite(rollouts[0].reward) and rollouts[0].reward == 0.0


def test_a_stepped_env_that_cannot_be_pickled_back_errors_its_rollout_with_its_text(caplog):
    """Its worker answers the turn with its text and a line naming what did not pickle, and
    lives on: the other rollouts' turns finish in it, and no worker is replaced."""
    env_config = EnvConfig(max_turns=4, max_rollout_tokens=1000, workers=1)
    environment = KeepsALambdaEnvironment(env_config, seed=0)
    rollouter = rollouter_for(environment, env_config, prompts_per_step=2)
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl.rollout.env_workers"):
        groups = collect(rollouter, ScriptedGenerate(lambda c: "ok"), [-1, PLANS.index("ok")])
    assert [r.getMessage() for r in caplog.records] == []
    bad, ok = sorted(groups, key=lambda g: g.sample_index)
    for rollout in bad.rollouts:
        assert rollout.status is RolloutStatus.ERROR_ENV
        assert rollout.error.startswith(
            "the stepped KeepsALambdaEnv (turn 1) cannot be pickled back from its worker "
            "process (AttributeError: Can't pickle local object 'KeepsALambdaEnv.step."
        )
        assert rollout.messages[-1] == {"role": "assistant", "content": "ok"}  # the text kept
        assert len(rollout.messages) == 4 and rollout.error_details
    assert [r.status for r in ok.rollouts] == [RolloutStatus.COMPLETED] * 2
    assert all(len(r.turns) == 3 for r in ok.rollouts)


def test_a_rubric_the_workers_cannot_load_stops_the_batch_with_one_line(monkeypatch):
    import sys
    import types

    from torchtitan_rl.envs.base import Rubric

    ghost = types.ModuleType("ghost_rubric")  # importable here only, not in a new process
    exec("def reward(rollout):\n    return 1.0", ghost.__dict__)
    ghost.reward.__module__ = "ghost_rubric"
    monkeypatch.setitem(sys.modules, "ghost_rubric", ghost)
    env_config = EnvConfig(workers=1)
    environment = PlanEnvironment(env_config, seed=0)
    environment.rubric = lambda: Rubric([("reward", ghost.reward, 1.0)])
    rollouter = rollouter_for(environment, env_config, prompts_per_step=1)
    with pytest.raises(RuntimeError) as e:
        collect(rollouter, ScriptedGenerate(lambda c: "ok"), [0])
    assert str(e.value) == (
        "env.workers=1: a worker process cannot load the rubric: "
        "ModuleNotFoundError: No module named 'ghost_rubric'"
    )
    assert multiprocessing.active_children() == []


def test_a_renderer_the_workers_cannot_load_stops_the_batch_with_one_line(monkeypatch):
    import sys
    import types

    ghost = types.ModuleType("ghost_renderer")  # importable here only, not in a new process
    exec("from fake_renderer import FakeRenderer\nclass Ghost(FakeRenderer): pass", ghost.__dict__)
    ghost.Ghost.__module__ = "ghost_renderer"
    monkeypatch.setitem(sys.modules, "ghost_renderer", ghost)
    env_config = EnvConfig(workers=1)
    environment = PlanEnvironment(env_config, seed=0)
    rollouter = rollouter_for(environment, env_config, ghost.Ghost(), prompts_per_step=1)
    with pytest.raises(RuntimeError) as e:
        collect(rollouter, ScriptedGenerate(lambda c: "ok"), [0])
    assert str(e.value) == (
        "env.workers=1: a worker process cannot load the renderer: "
        "ModuleNotFoundError: No module named 'ghost_renderer'"
    )
    assert multiprocessing.active_children() == []
