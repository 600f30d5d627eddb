"""Where a rollout's environment code runs: `MessageEnv.init` / `step`, the tokenizing around
them, and rubric scoring.

Two implementations of one seam, chosen by `env.workers`:

    LocalCalls   (env.workers = 0)  on the controller's event loop, as the env's own coroutines
    EnvWorkers   (env.workers = N)  in N worker processes (rollout/env_workers.py)

Three calls: `open` (init, its messages checked, the first prompt rendered), `turn` (a whole
assistant turn, rollout/env_turn.py: the completion decoded, the env stepped, its reply
encoded) and `score`. Both report the same outcomes, so a rollout errors the same way wherever
its env ran:

    the call returned                 -> (env, value); a worker returns its copy of the env
    a turn failed (env.step raised or -> a TurnResult with its error status, text and line
      took over step_timeout_s, the      (rollout/env_turn.py)
      renderer raised)
    env.init took over it             -> TimeoutError("env.init exceeded env.step_timeout_s=30.0")
    a worker was killed, stuck in a   -> TimeoutError(a line naming what ran, rollout/
      call past step_timeout_s + grace   env_workers.py); nothing was parsed on this loop
    user code raised (a TimeoutError  -> EnvCallFailed(error="ValueError: ...", details=traceback)
      of its own included), the first    (in a turn: only what take_turn did not foresee)
      prompt did not encode
    a worker died during a call       -> EnvCallFailed("an env worker process ... died ...")
    init gave malformed messages      -> EnvCallFailed(error="<Env>.init: message 0 is ...")

A TimeoutError's message is the rollout's error line (TokenEnv records it as it is).
"""

from __future__ import annotations

import asyncio
from traceback import format_exc
from typing import TYPE_CHECKING, Any, Protocol

from torchtitan_rl.rollout.env_turn import (
    EnvCallFailed,
    Turn,
    TurnResult,
    checked_messages,
    describe_exception,
    take_turn,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable

    import numpy as np

    from torchtitan_rl.envs.base import MessageEnv, Rubric, StepResult
    from torchtitan_rl.models.renderer import Renderer
    from torchtitan_rl.types import Message, Rollout

Score = tuple[float, dict[str, float], str | None]
"""What scoring gives: (weighted reward, {function name: value}, `rollout.scorer_error`)."""
Opening = tuple["MessageEnv", list["Message"], "np.ndarray"]
"""What `open` gives: (the env, its checked first messages, the first prompt's int32 ids)."""


class EnvCalls(Protocol):
    """Runs environment code for the Rollouter; see the module docstring for outcomes."""

    async def open(self, env: MessageEnv) -> Opening: ...

    async def turn(self, env: MessageEnv, turn: Turn) -> tuple[MessageEnv, TurnResult]: ...

    async def score(self, rollout: Rollout) -> Score: ...

    def close(self) -> None:
        """Stop whatever runs calls; nothing is left running afterwards."""


class LocalCalls:
    """Env coroutines awaited on the caller's event loop, each init and step bounded by
    `timeout_s` (None: unbounded); the tokenizing and the rubric run inline, unbounded
    (synchronous code on the loop cannot be interrupted). `renderer` is needed for `open`
    and `turn`, `rubric` for `score`."""

    def __init__(
        self,
        timeout_s: float | None,
        rubric: Rubric | None = None,
        renderer: Renderer | None = None,
    ) -> None:
        self._timeout_s = timeout_s
        self._rubric = rubric
        self._renderer = renderer

    async def open(self, env: MessageEnv) -> Opening:
        assert self._renderer is not None, "LocalCalls was built without a renderer"
        first = await self._bounded("env.init", env.init())
        try:
            messages = checked_messages(first, f"{type(env).__name__}.init")
        except ValueError as e:
            raise EnvCallFailed(str(e)) from e
        try:
            return env, messages, self._renderer.render_prompt(messages)
        except Exception as e:  # a first prompt the tokenizer refuses errors its rollout only
            what = f"{type(self._renderer).__name__}.render_prompt"
            raise EnvCallFailed(f"{what} raised {describe_exception(e)}", format_exc()) from e

    async def turn(self, env: MessageEnv, turn: Turn) -> tuple[MessageEnv, TurnResult]:
        assert self._renderer is not None, "LocalCalls was built without a renderer"
        try:
            return env, await take_turn(env, turn, self._renderer, self._step)
        except Exception as e:  # what take_turn did not foresee errors the rollout, not the
            raise EnvCallFailed.from_current(e) from e  # run, and a worker lives on

    async def _step(self, env: MessageEnv, text: str) -> StepResult:
        return await self._bounded("env.step", env.step(text))

    async def _bounded(self, what: str, call: Awaitable[Any]) -> Any:
        """`call` (the env's `what`) bounded by timeout_s."""
        try:
            return await asyncio.wait_for(_own(call), timeout=self._timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{what} exceeded env.step_timeout_s={self._timeout_s}") from None
        except EnvCallFailed:
            raise
        except Exception as e:  # a user env failing is recorded on the rollout, not fatal
            raise EnvCallFailed.from_current(e) from e

    async def score(self, rollout: Rollout) -> Score:
        assert self._rubric is not None, "LocalCalls was built without a rubric"
        return score_with(self._rubric, rollout)

    def close(self) -> None:
        pass


def score_with(rubric: Rubric, rollout: Rollout) -> Score:
    """`rubric.score(rollout)` as a Score; EnvCallFailed when a reward function raised."""
    try:
        reward, breakdown = rubric.score(rollout)
    except Exception as e:  # a failing reward fn marks the rollout, never a silent 0
        raise EnvCallFailed.from_current(e) from e
    return reward, breakdown, rollout.scorer_error


async def run_call(call: tuple[Any, ...], calls: LocalCalls) -> Any:
    """One ("open", env) / ("turn", env, Turn) / ("score", rollout) call on `calls`: how a
    worker process runs what it is sent."""
    kind, *args = call
    if kind == "open":
        return await calls.open(*args)
    if kind == "turn":
        return await calls.turn(*args)
    assert kind == "score", kind
    return await calls.score(*args)


async def _own(call: Awaitable[Any]) -> Any:
    """`call`, a TimeoutError it raises itself (its own client's deadline, an HTTP 504)
    turned into EnvCallFailed with its traceback: the env's failure, where wait_for's
    TimeoutError is the bound's."""
    try:
        return await call
    except TimeoutError as e:
        raise EnvCallFailed.from_current(e) from e
