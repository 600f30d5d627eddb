"""A verifiers 0.4.0 environment as our Environment: its episodes run unmodified, in-process.

Each rollout is one verifiers episode, `Env.run_episode(task, ctx)`: the Env's own
`setup`/`run`/`finalize`, its agents and interactions, the task's hooks and limits, its
`@reward`/`@metric` scoring, and the interception server that serves every model call, all
verifiers' code. Each agent's program is verifiers' `null` harness (its tool-less chat loop,
the program `vf-eval` runs for a chat taskset), launched per segment as verifiers launches it.
Two things are ours:

  - the model client: verifiers builds it from `ctx.client`, one per endpoint config
    (`InterceptionServer._client`, interception/server.py); the rollout's `GenerateFnClient`
    (envs/verifiers_client.py) is handed to the server under its config instead, so every
    completion comes from our generator on our renderer's tokens;
  - the chat program's interpreter: verifiers would build one with `uv sync --script` (from
    the network; runtimes/base.py `prepare_uv_script`); its dependencies are verifiers' own,
    so this Python runs it (`use_this_python_for_the_chat_program`).

Every role runs locally (subprocess runtime) with the `null` harness; env.max_turns and
env.max_rollout_tokens cap each agent (verifiers' max_turns and max_total_tokens). A sample is
`{"index": i, "key": task key, "prompt": prompt text}` of the taskset's task i; which split a
task is on is decided by a hash of its key (`envs/split.py`). The rollout trains on the
episode's one trainable agent (envs/verifiers_episode.py); its reward is verifiers' weighted
sum of the trace's rewards.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pydantic
from verifiers.v1 import ModelContext, TrainClientConfig
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.harnesses.null import NullHarnessConfig
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.interception import InterceptionServer, InterceptionServerConfig
from verifiers.v1.runtimes import SubprocessConfig
from verifiers.v1.runtimes.subprocess import SubprocessRuntime
from verifiers.v1.utils.loaders import environment_class, load_taskset, resolve_env_config

from torchtitan_rl.checks import check_range
from torchtitan_rl.envs.base import EnvConfig, EpisodeEnvironment, Rubric
from torchtitan_rl.envs.split import Split, is_validation, split_sample
from torchtitan_rl.envs.verifiers_client import GenerateFnClient
from torchtitan_rl.envs.verifiers_episode import REWARD, fill_rollout, verifiers_reward
from torchtitan_rl.types import GenerateFn, Rollout, SamplingParams

HARNESS = "null"
"""The harness every role runs: verifiers' tool-less chat loop (our renderer has no tools)."""
CHAT_PROGRAM_MODULES = ("openai", "mcp", "httpx", "httpx2", "tenacity", "certifi")
"""The chat program's declared dependencies (`CHAT_PROGRAM`, harnesses/utils/launch.py)."""
OWN_KEYS = ("id", "taskset")
"""verifiers [env] keys with an env.args key of their own (not in env.args.env)."""
ENDPOINT = "http://torchtitan-rl.invalid"
"""The base URL of each rollout's client config: never dialed (its client is ours), unique
per rollout (`.../<session id>`) so the server keeps one client per rollout."""
NO_KEY = "TORCHTITAN_RL_NO_API_KEY"
"""The client config's API-key variable; a name of ours, so no Prime login is looked up."""


@dataclass(kw_only=True, slots=True)
class VerifiersArgs:
    """[env.args] of "verifiers:<taskset id>": verifiers' own [env] settings."""

    taskset_id: ClassVar[str] = ""

    id: str = ""
    """A verifiers Env id to play the taskset with (verifiers' env.id, e.g. "user-sim");
    "" = the taskset's own Env, else verifiers' SingleAgentEnv."""
    taskset: dict[str, Any] = field(default_factory=dict)
    """The taskset's own settings (verifiers' [env.taskset] less its id)."""
    env: dict[str, Any] = field(default_factory=dict)
    """The rest of verifiers' [env] table: the Env's own fields and its roles, e.g.
    {max_guesses = 3, user = {max_turns = 4}}. A role's harness (only "null") and runtime
    are ours."""
    size: int = 0
    """Tasks read from the taskset: its first `size`, or 0 for all (an infinite taskset
    needs a size)."""
    max_concurrent: int = 16
    """Episodes played at once, >= 1 (each turn of each runs a Python process); the rest
    wait their turn."""

    def validate(self) -> None:
        check_range("env.args.size", self.size, ge=0)
        check_range("env.args.max_concurrent", self.max_concurrent, ge=1)
        verifiers_config(self)

    @property
    def table(self) -> dict[str, Any]:
        """verifiers' [env] table these settings stand for."""
        for key in OWN_KEYS:
            if key in self.env:
                raise ValueError(f"env.args.env.{key}: set it as env.args.{key}")
        if "interception" in self.env:
            raise ValueError("env.args.env.interception: torchtitan_rl serves the model calls")
        return {**self.env, "id": self.id, "taskset": {**self.taskset, "id": self.taskset_id}}


def verifiers_config(args: VerifiersArgs) -> Any:
    """The validated verifiers EnvConfig of `args`; ValueError (one line naming the env.args
    key) for a bad key or a role that pins a harness other than "null" or a runtime."""
    try:
        config = resolve_env_config(args.table)
    except pydantic.ValidationError as e:
        error = e.errors()[0]
        raise ValueError(f"{_our_key(error['loc'])}: {error['msg']}") from None
    except (ImportError, TypeError, AttributeError) as e:  # env.args.id naming no Env
        raise ValueError(f"env.args.id={args.id!r}: {str(e).splitlines()[0]}") from e
    for role, agent in agent_config_fields(config).items():
        if agent.harness is not None and agent.harness.id != HARNESS:
            raise ValueError(
                f"env.args.env.{role}.harness: role {role!r} runs harness "
                f"{agent.harness.id!r}; torchtitan_rl runs every role with verifiers' "
                f"tool-less {HARNESS!r} chat harness"
            )
        if "runtime" in args.env.get(role, {}):
            raise ValueError(f"env.args.env.{role}.runtime: every role runs here, locally")
    return config


def _our_key(loc: tuple) -> str:
    """A key path of verifiers' [env] table as the env.args key that sets it."""
    head, *rest = (str(part) for part in loc)
    section = f"env.args.{head}" if head in OWN_KEYS else f"env.args.env.{head}"
    return ".".join([section, *rest])


def run_config(config: Any, env: EnvConfig) -> Any:
    """`config` with our parts: every role local, on the null harness, within our limits;
    one interception server (on loopback) per episode."""
    roles = {}
    for role, agent in agent_config_fields(config).items():
        roles[role] = agent.model_copy(
            update={
                "harness": NullHarnessConfig(id=HARNESS),
                "runtime": SubprocessConfig(),
                "max_turns": _least(agent.max_turns, env.max_turns),
                "max_total_tokens": _least(agent.max_total_tokens, env.max_rollout_tokens),
            }
        )
    return config.model_copy(update={**roles, "interception": InterceptionServerConfig()})


def _least(theirs: int | None, ours: int) -> int:
    return ours if theirs is None else min(theirs, ours)


def use_this_python_for_the_chat_program() -> None:
    """Let verifiers run the null harness's chat program on this Python. verifiers keeps
    the script at `<scripts_dir>/<sha256>.py` and, once `uv sync --script` made an
    interpreter for it, caches that interpreter by the script's path
    (`SubprocessRuntime._interpreters`); the script written there and this interpreter
    cached, verifiers launches it as it would after uv."""
    missing = [m for m in CHAT_PROGRAM_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"verifiers' chat program needs {missing}, which are not installed: "
            "pip install 'torchtitan_rl[verifiers]'"
        )
    digest = hashlib.sha256(CHAT_PROGRAM_SOURCE.encode()).hexdigest()
    path = Path(SubprocessRuntime.scripts_dir) / f"{digest}.py"
    if not path.is_file() or path.read_text() != CHAT_PROGRAM_SOURCE:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(CHAT_PROGRAM_SOURCE)
        temporary.replace(path)
    SubprocessRuntime._interpreters[str(path)] = sys.executable


class VerifiersEnvironment(EpisodeEnvironment):
    """The adapter; `verifiers_environment(taskset_id)` makes its per-taskset subclass."""

    taskset_id: ClassVar[str] = ""
    config_class: ClassVar[type | None] = VerifiersArgs

    def __init__(self, config: EnvConfig, seed: int, args: Any = None):
        super().__init__(config, seed, args)
        name = f"verifiers:{self.taskset_id}"
        try:
            self.verifiers_config = run_config(verifiers_config(self.args), config)
        except ValueError as e:
            raise ValueError(f"env.args of {name!r}: {e}") from e
        self.env_class = environment_class(self.taskset_id, self.args.id)
        taskset = load_taskset(self.verifiers_config.taskset)
        if self.args.size:
            taskset = taskset.take(self.args.size)
        if not taskset.bounded:
            raise ValueError(f"env.args.size: {name} is infinite; say how many tasks to read")
        self.tasks = list(taskset)
        keys = [task.key for task in self.tasks]
        held_out = sum(is_validation(key) for key in keys)
        if held_out in (0, len(keys)):
            raise ValueError(
                f"{name}: {held_out} of its {len(keys)} tasks are held out for validation "
                "(a hash of the task key picks about 1 in 8); both splits need a task"
            )
        self.keys = keys
        self._gate: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        """(loop, the semaphore bounding its episodes to env.args.max_concurrent)."""
        use_this_python_for_the_chat_program()

    def _episodes(self) -> asyncio.Semaphore:
        """The running loop's episode semaphore (a semaphore belongs to one loop)."""
        loop = asyncio.get_running_loop()
        if self._gate is None or self._gate[0] is not loop:
            self._gate = (loop, asyncio.Semaphore(self.args.max_concurrent))
        return self._gate[1]

    def _draw(self, rng: random.Random) -> dict[str, Any]:
        index = rng.randrange(len(self.tasks))
        prompt = self.tasks[index].data.prompt_text
        return {"index": index, "key": self.keys[index], "prompt": prompt}

    def _sample(self, split: Split, index: int) -> dict[str, Any]:
        return split_sample(
            f"verifiers/{self.taskset_id}",
            seed=self.seed,
            split=split,
            index=index,
            draw=self._draw,
            content=lambda s: s["key"],
        )

    def train_sample(self, index: int) -> dict[str, Any]:
        return self._sample("train", index)

    def validation_samples(self, n: int) -> list[dict[str, Any]]:
        return [self._sample("validation", i) for i in range(n)]

    def rubric(self) -> Rubric:
        return Rubric([(REWARD, verifiers_reward, 1.0)])

    async def play(
        self,
        rollout: Rollout,
        generate_fn: GenerateFn,
        *,
        renderer: Any,
        sampling: SamplingParams,
        seed_of_turn: Callable[[int], int],
    ) -> None:
        """One verifiers episode of the sample's task, served by a client of this rollout
        alone, on an Env and an interception server of its own (no state is shared between
        concurrent episodes)."""
        client = GenerateFnClient(
            generate_fn,
            renderer,
            sampling,
            session_id=rollout.session_id,
            seed_of_turn=seed_of_turn,
            max_rollout_tokens=self.config.max_rollout_tokens,
        )
        endpoint = TrainClientConfig(
            base_url=f"{ENDPOINT}/{rollout.session_id}", api_key_var=NO_KEY
        )
        env = self.env_class(self.verifiers_config)

        def name_trace(trace: Any) -> None:
            client.name_trace(trace.id, agent=trace.agent.name, trained=trace.agent.trainable)

        async with self._episodes(), env.serving():
            # serving() built it from our InterceptionServerConfig; verifiers 0.4.0 has no
            # public way to give it a client object, so ours goes in its client table
            server = env._interception
            assert isinstance(server, InterceptionServer)
            server.clients[endpoint.model_dump_json()] = client
            task = self.tasks[rollout.sample["index"]]
            ctx = ModelContext(model="policy", client=endpoint)
            episode = await env.run_episode(task, ctx, on_trace=name_trace)
        fill_rollout(rollout, episode, client)
