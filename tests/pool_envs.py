"""Environments for the env.workers tests: picklable (module-level classes and reward
functions) and free of torch imports, so a worker process loads them in a moment.

PlanEnvironment's sample `index` picks a plan from PLANS, the same for every rollout of a
group: how its env's init and steps behave and what its reward function does.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from torchtitan_rl.envs.base import (
    EnvConfig,
    Environment,
    MessageEnv,
    Rubric,
    StepResult,
    WrongAnswer,
)
from torchtitan_rl.types import Message, Rollout

UNENCODABLE = "<unencodable>"
"""Text FussyRenderer (fake_renderer.py) refuses to encode."""

PLANS = (
    "ok",  # three turns, reward = number of turns / 10
    "init_raises",
    "step_raises",  # on the second turn
    "step_hangs",  # awaits far past env.step_timeout_s
    "step_blocks",  # sleeps (holding its thread) far past env.step_timeout_s
    "step_exits",  # the process running the step exits
    "not_a_step_result",
    "reward_raises",
    "reward_wrong_answer",
    "reward_nan",
    "step_raises_timeout",  # its own TimeoutError (a client's deadline), at once
    "step_hangs_holding_a_task",  # awaits a task kept on the env, past env.step_timeout_s
    "prompt_unencodable",  # its first message holds UNENCODABLE
    "reply_unencodable",  # its second reply holds UNENCODABLE
    "completion_undecodable",  # the tests' generator answers its second turn with UNDECODABLE
    "signals_not_a_dict",  # on the second turn
)
HANG_S = 600.0
"""Far longer than any test's step_timeout_s: only the timeout ends such a step."""


class PlanEnv(MessageEnv):
    def __init__(self, plan: str):
        self.plan = plan
        self.turn = 0
        self.pending: asyncio.Future | None = None

    async def init(self) -> list[Message]:
        if self.plan == "init_raises":
            raise KeyError("no such puzzle")
        mark = UNENCODABLE if self.plan == "prompt_unencodable" else ""
        return [{"role": "user", "content": f"plan {self.plan}{mark}"}]

    async def step(self, assistant_message: str) -> StepResult:
        self.turn += 1
        if self.turn == 2:
            if self.plan == "step_raises":
                raise ValueError(f"cannot parse {assistant_message!r}")
            if self.plan == "step_hangs":
                await asyncio.sleep(HANG_S)
            if self.plan == "step_blocks":
                time.sleep(HANG_S)
            if self.plan == "step_raises_timeout":
                raise TimeoutError("the sandbox's own deadline")
            if self.plan == "step_hangs_holding_a_task":  # a task does not pickle
                self.pending = asyncio.ensure_future(asyncio.sleep(HANG_S))
                await self.pending
            if self.plan == "step_exits":
                os._exit(3)
            if self.plan == "not_a_step_result":
                return "done"  # type: ignore[return-value]
            if self.plan == "signals_not_a_dict":
                return StepResult(messages=[], done=False, reward_signals=None)  # type: ignore[arg-type]
        mark = UNENCODABLE if self.plan == "reply_unencodable" and self.turn == 2 else ""
        reply = [{"role": "user", "content": f"turn {self.turn} of {assistant_message}{mark}"}]
        done = self.turn == 3
        return StepResult(messages=[] if done else reply, done=done, reward_signals={"t": 1.0})


class KeepsALambdaEnv(PlanEnv):
    """Plays "ok", but keeps a lambda once stepped twice: stepped in a worker, it cannot be
    pickled back."""

    async def step(self, assistant_message: str) -> StepResult:
        result = await super().step(assistant_message)
        if self.turn == 2:
            self.on_close = lambda: None
        return result


def plan_reward(rollout: Rollout) -> float:
    plan = PLANS[rollout.sample["index"] % len(PLANS)]
    if plan == "reward_raises":
        raise ZeroDivisionError("a bug in the reward")
    if plan == "reward_wrong_answer":
        raise WrongAnswer("ValueError: 'seven' is not a number")
    if plan == "reward_nan":
        return float("nan")
    return len(rollout.turns) / 10


class PlanEnvironment(Environment):
    def train_sample(self, index: int) -> dict[str, Any]:
        return {"index": index}

    def validation_samples(self, n: int) -> list[dict[str, Any]]:
        return [{"index": i} for i in range(n)]

    def make_env(self, sample: dict[str, Any]) -> MessageEnv:
        return PlanEnv(PLANS[sample["index"] % len(PLANS)])

    def rubric(self) -> Rubric:
        return Rubric([("reward", plan_reward, 1.0)])


class KeepsALambdaEnvironment(PlanEnvironment):
    """PlanEnvironment whose sample -1 gets a KeepsALambdaEnv."""

    def make_env(self, sample: dict[str, Any]) -> MessageEnv:
        return KeepsALambdaEnv("ok") if sample["index"] == -1 else super().make_env(sample)


class WaitingEnv(MessageEnv):
    """One turn whose step blocks its thread until the file `flag` exists (at most
    `wait_s`), after writing the file `started`; its reward says whether it saw the flag."""

    def __init__(self, folder: str, wait_s: float):
        self.folder = Path(folder)
        self.wait_s = wait_s

    async def init(self) -> list[Message]:
        return [{"role": "user", "content": "wait"}]

    async def step(self, assistant_message: str) -> StepResult:
        (self.folder / "started").touch()
        end = time.monotonic() + self.wait_s
        while not (self.folder / "flag").exists() and time.monotonic() < end:
            time.sleep(0.001)  # holds the thread, as a heavy synchronous step does
        seen = float((self.folder / "flag").exists())
        return StepResult(messages=[], done=True, reward_signals={"saw_flag": seen})


def saw_flag(rollout: Rollout) -> float:
    return rollout.turns[-1].reward_signals["saw_flag"]


class WaitingEnvironment(Environment):
    """Samples are {"folder": str, "wait_s": float}."""

    def __init__(self, config: EnvConfig, seed: int = 0):
        super().__init__(config, seed)

    def train_sample(self, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def validation_samples(self, n: int) -> list[dict[str, Any]]:
        raise NotImplementedError

    def make_env(self, sample: dict[str, Any]) -> MessageEnv:
        return WaitingEnv(sample["folder"], sample["wait_s"])

    def rubric(self) -> Rubric:
        return Rubric([("saw_flag", saw_flag, 1.0)])


class BigStateEnv(MessageEnv):
    """One turn; carries `size` bytes of state (a long document), there and back at each call."""

    def __init__(self, size: int):
        self.document = "x" * size

    async def init(self) -> list[Message]:
        return [{"role": "user", "content": "read"}]

    async def step(self, assistant_message: str) -> StepResult:
        return StepResult(messages=[], done=True)


def one(rollout: Rollout) -> float:
    return 1.0


class BigStateEnvironment(Environment):
    """Samples are {"size": int}."""

    def train_sample(self, index: int) -> dict[str, Any]:
        return {"size": 1_000_000}

    def validation_samples(self, n: int) -> list[dict[str, Any]]:
        raise NotImplementedError

    def make_env(self, sample: dict[str, Any]) -> MessageEnv:
        return BigStateEnv(sample["size"])

    def rubric(self) -> Rubric:
        return Rubric([("one", one, 1.0)])


class BreakingEnv(MessageEnv):
    """One turn whose step waits for the file `started` (another env's step is running),
    writes the file `broken`, then ends its process."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    async def init(self) -> list[Message]:
        return [{"role": "user", "content": "break"}]

    async def step(self, assistant_message: str) -> StepResult:
        while not (self.folder / "started").exists():
            time.sleep(0.001)
        (self.folder / "broken").touch()
        os._exit(3)


class RelayEnvironment(WaitingEnvironment):
    """Samples are {"folder": str, "wait_s": float} (a WaitingEnv) or {"folder": str,
    "breaks": True} (a BreakingEnv)."""

    def make_env(self, sample: dict[str, Any]) -> MessageEnv:
        if sample.get("breaks"):
            return BreakingEnv(sample["folder"])
        return super().make_env(sample)
