"""TokenEnv: adapts a chat-level MessageEnv to token space (token in, token out).

The prompt of turn t+1 is built by appending to the prompt of turn t, never by re-rendering
the conversation:

    prompt_1 = prompt_0 + A0 + render_continuation(E0)

where A0 are the completion ids exactly as sampled (never re-tokenized from text) and E0 the
env's reply messages. So every turn's prompt starts with the previous turn's prompt plus its
completion, which is what lets `rollout_to_episodes` pack a whole rollout into one sequence.

The env and the tokenizing around it (parsing A0, rendering E0) run where the EnvCalls runs
them (rollout/env_turn.py: on this event loop, or in an env worker process); TokenEnv keeps
the prompt and the messages and decides how the rollout ended.

Limits (from EnvConfig), checked in this order after each completion:
    generator gave None / ERROR / ABORT       -> ERROR_GENERATOR
    the renderer's stop-token check raised    -> ERROR_ENV (naming closed_by_stop_token and
                                                 the exception; no text: the completion is
                                                 not parsed; on this loop, workers or not)
    the renderer cannot parse the completion  -> ERROR_PARSE (a ValueError's line; another
                                                 exception's names the renderer's method)
    completion finish_reason LENGTH           -> TRUNCATED_LENGTH (env.step is not called:
                                                 the message is cut; the rubric still scores
                                                 what exists)
    env.step raised / exceeded step_timeout_s -> ERROR_ENV / ERROR_TIMEOUT ("env.step exceeded
                                                 env.step_timeout_s=30.0", the turn's text kept)
    an env worker killed, stuck in the turn   -> ERROR_TIMEOUT (its line names the whole turn;
      past step_timeout_s + grace                no text: the completion is not parsed again)
    an env worker died in the turn            -> ERROR_ENV (its line says so; no text either)
    the turn's answer does not pickle back    -> ERROR_ENV (naming what did not pickle: the
      from its env worker                        stepped env, or its reply; the text kept)
    env.step gave no StepResult, or a message -> ERROR_ENV (naming the env class, the
      UTF-8 cannot encode (a lone surrogate)     method, the turn and the message)
    the renderer raised encoding the reply    -> ERROR_ENV (naming its method and the exception;
                                                 the text and the reply kept)
    env said done                             -> COMPLETED
    max_turns assistant turns taken           -> TRUNCATED_TURNS
    next prompt leaves no room to generate    -> TRUNCATED_PROMPT
      (len(next_prompt) >= max_rollout_tokens: the budget covers prompt plus completion)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from traceback import format_exc
from typing import TYPE_CHECKING, Any

import numpy as np

from torchtitan_rl.rollout.env_calls import EnvCallFailed, EnvCalls, LocalCalls
from torchtitan_rl.rollout.env_turn import Turn, renderer_raised
from torchtitan_rl.types import Completion, FinishReason, Message, RolloutStatus

if TYPE_CHECKING:
    from torchtitan_rl.envs.base import EnvConfig, MessageEnv
    from torchtitan_rl.models.renderer import Renderer


class TokenEnvError(Exception):
    """The env failed before the first turn (init raised or timed out)."""

    def __init__(self, status: RolloutStatus, message: str, details: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.details = details
        """The traceback of the env's exception, when one was raised."""


@dataclass(kw_only=True, slots=True)
class TokenStep:
    """What one assistant turn did to the rollout."""

    next_prompt_ids: np.ndarray | None
    """int32 prompt for the next turn; None once the rollout is done."""
    done: bool
    """True when the rollout ends after this turn (for any reason)."""
    status: RolloutStatus | None
    """How the rollout ended; None while it continues."""
    assistant_text: str = ""
    """The completion parsed to text ("" when the generator failed)."""
    env_messages: list[Message] = field(default_factory=list)
    """The env's reply messages to this turn (empty when the env was not stepped)."""
    reward_signals: dict[str, float] = field(default_factory=dict)
    """Per-turn signals the env reported."""
    error: str | None = None
    """Human-readable cause when status is an error."""
    error_details: str | None = None
    """The traceback behind `error`, when user code raised."""


class TokenEnv:
    """One rollout's conversation in token space; create one per rollout."""

    def __init__(
        self,
        env: MessageEnv,
        renderer: Renderer,
        config: EnvConfig,
        calls: EnvCalls | None = None,
    ) -> None:
        """`calls` runs the env's init and turns (default: on this event loop, bounded by
        `config.step_timeout_s`); with worker processes the env comes back as a new object."""
        self._env = env
        self._calls: EnvCalls = calls or LocalCalls(config.step_timeout_s, renderer=renderer)
        self._renderer = renderer
        self._config = config
        self._messages: list[Message] = []
        self._prompt_ids = np.zeros(0, dtype=np.int32)
        self._num_turns = 0

    @property
    def messages(self) -> list[Message]:
        """The conversation so far (init messages, assistant turns, env replies)."""
        return self._messages

    @property
    def num_turns(self) -> int:
        return self._num_turns

    async def reset(self) -> np.ndarray:
        """Start the episode; returns the first prompt ids. Raises TokenEnvError on env failure."""
        try:
            self._env, self._messages, prompt_ids = await self._calls.open(self._env)
        except TimeoutError as e:  # its message is the line (rollout/env_calls.py)
            raise TokenEnvError(RolloutStatus.ERROR_TIMEOUT, str(e)) from e
        except EnvCallFailed as e:  # a user env failing is recorded on the rollout, not fatal
            raise TokenEnvError(RolloutStatus.ERROR_ENV, e.error, e.details) from e
        self._prompt_ids = np.asarray(prompt_ids, np.int32)
        self._num_turns = 0
        return self._prompt_ids

    async def step(self, completion: Completion | None) -> TokenStep:
        """Feed one sampled completion; returns the next prompt or how the rollout ended."""
        if completion is None:
            return _ended(RolloutStatus.ERROR_GENERATOR, error="generator returned no completion")
        if completion.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            reason = completion.error or "no message"
            return _ended(
                RolloutStatus.ERROR_GENERATOR,
                error=f"completion {completion.finish_reason.value}: {reason}",
            )
        try:
            closed = self._renderer.closed_by_stop_token(completion)
        except Exception as e:  # a renderer's bug ends the rollout, not the batch
            error = renderer_raised(self._renderer, "closed_by_stop_token", self._num_turns, e)
            return _ended(RolloutStatus.ERROR_ENV, error=error, error_details=format_exc())
        turn = Turn(
            completion_ids=completion.token_ids_N,
            cut=completion.finish_reason == FinishReason.LENGTH,
            closed=closed,
            index=self._num_turns,
            last=self._num_turns + 1 >= self._config.max_turns,
        )
        try:
            self._env, result = await self._calls.turn(self._env, turn)
        # A worker stuck in the turn and killed, or one that died in it, brings back no text.
        # What it ran (a parse, a step, an encoding) may never end, raise or kill its process
        # again, so it is not run here, on the loop, to learn the text: the rollout ends
        # without the turn's assistant message, its completion kept in its turns.
        except TimeoutError as e:
            return _ended(RolloutStatus.ERROR_TIMEOUT, error=str(e))
        except EnvCallFailed as e:  # recorded on the rollout, not fatal
            return _ended(RolloutStatus.ERROR_ENV, error=e.error, error_details=e.details)
        if result.text is None:  # it did not parse: not a turn
            return _ended(result.status, error=result.error, error_details=result.error_details)
        self._add_turn(result.text, result.reply)
        fields = dict(
            assistant_text=result.text,
            env_messages=result.reply,
            reward_signals=result.reward_signals,
            error=result.error,
            error_details=result.error_details,
        )
        if result.status is not None:
            return _ended(result.status, **fields)
        assert result.continuation is not None
        next_prompt = np.concatenate(
            [
                self._prompt_ids,
                np.asarray(completion.token_ids_N, np.int32),
                np.asarray(result.continuation, np.int32),
            ]
        )
        if next_prompt.shape[0] >= self._config.max_rollout_tokens:
            return _ended(RolloutStatus.TRUNCATED_PROMPT, **fields)
        self._prompt_ids = next_prompt
        return TokenStep(next_prompt_ids=next_prompt, done=False, status=None, **fields)

    def _add_turn(self, text: str, reply: list[Message]) -> None:
        self._num_turns += 1
        self._messages.append({"role": "assistant", "content": text})
        self._messages.extend(reply)


def _ended(status: RolloutStatus, **fields: Any) -> TokenStep:
    return TokenStep(next_prompt_ids=None, done=True, status=status, **fields)
