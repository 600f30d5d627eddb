"""One assistant turn, played where the rollout's env runs: the completion parsed to text,
the env stepped, its reply checked and rendered to the ids that follow the completion.

TokenEnv (rollout/token_env.py) keeps the rollout's prompt and messages and sends each turn
to its EnvCalls: LocalCalls plays it on the controller's event loop, EnvWorkers in a worker
process that holds its own copy of the renderer, so a turn's tokenizing leaves the loop with
the env's step. A 2-turn rollout, prompt P0, completions A0 and A1:

    Turn(completion_ids=A0, cut=False, closed=True, index=0, last=False)
        -> TurnResult(status=None, text=text(A0), reply=[E0], continuation=C0)
           C0 = render_continuation([E0], closed=True); TokenEnv: P1 = P0 + A0 + C0
    Turn(completion_ids=A1, cut=False, closed=True, index=1, last=True)
        -> TurnResult(status=TRUNCATED_TURNS, text=text(A1), reply=[E1], continuation=None)

A turn's failures end it here, with its text once decoded, the same on the event loop and in
a worker (which lives on):

    env.step ran past env.step_timeout_s -> TurnResult(status=ERROR_TIMEOUT, text=text(A1),
                                            error="env.step exceeded env.step_timeout_s=30.0")
    env.step raised                      -> TurnResult(status=ERROR_ENV, text=text(A1),
                                            error="KeyError: 'x'", error_details=traceback)
    the completion does not decode       -> TurnResult(status=ERROR_PARSE, text=None, error=
                                            "ValueError: ..."; another exception's line names
                                            the renderer's method, with its traceback)
    the env's reply does not encode      -> TurnResult(status=ERROR_ENV, text=text(A1),
                                            reply=[E1], error="<Renderer>.render_continuation
                                            (turn 1) raised ...", error_details=traceback)
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from torchtitan_rl.envs.base import StepResult
from torchtitan_rl.types import Message, RolloutStatus, ids_from_wire, ids_to_wire

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from torchtitan_rl.envs.base import MessageEnv
    from torchtitan_rl.models.renderer import Renderer


class EnvCallFailed(Exception):
    """User code (an env's init or step, a reward function) raised, or the worker process
    running it died; the rollout errors."""

    def __init__(self, error: str, details: str | None = None) -> None:
        super().__init__(error)
        self.error = error
        """One line, "TypeName: message"."""
        self.details = details
        """The traceback, as formatted where the code ran."""

    @classmethod
    def from_current(cls, e: BaseException) -> EnvCallFailed:
        """From the exception being handled (call inside its `except` block)."""
        return cls(describe_exception(e), traceback.format_exc())


def describe_exception(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


@dataclass(slots=True)
class Turn:
    """What a rollout sends where its env runs, once per assistant turn."""

    completion_ids: np.ndarray
    """int32 [N], the completion as sampled."""
    cut: bool
    """The completion ran into max_tokens (finish LENGTH): parsed, the env not stepped."""
    closed: bool
    """The completion sampled its own stop token (`Renderer.closed_by_stop_token`)."""
    index: int
    """Which assistant turn this is, from 0."""
    last: bool
    """env.max_turns assistant turns are taken with this one: nothing is rendered after it."""

    def __reduce__(self) -> tuple:  # see _turn
        ids = ids_to_wire(self.completion_ids)
        return _turn, (ids, self.cut, self.closed, self.index, self.last)


@dataclass(kw_only=True, slots=True)
class TurnResult:
    """What one turn did; TokenEnv turns it into a TokenStep."""

    status: RolloutStatus | None
    """How the rollout ended at this turn; None while it continues."""
    text: str | None = None
    """The completion parsed to text; None when it did not parse (ERROR_PARSE)."""
    reply: list[Message] = field(default_factory=list)
    """The env's checked reply messages (empty when the env was not stepped or failed)."""
    reward_signals: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    error_details: str | None = None
    """The traceback behind `error`, when user or renderer code raised."""
    continuation: np.ndarray | None = None
    """int32 ids that follow the completion in the next prompt, when status is None."""

    def __reduce__(self) -> tuple:  # see _turn
        status = None if self.status is None else self.status.value
        fields = (self.text, self.reply, self.reward_signals, self.error, self.error_details)
        return _turn_result, (status, *fields, ids_to_wire(self.continuation))


# Turn and TurnResult cross a pipe at every turn with env.workers, so they pickle as a tuple
# with their int32 ids as bytes: a numpy array of 128 ids took 7.4 + 4.9 us to pickle and
# load on the 2-core VM, its bytes 0.4 us; a slots dataclass adds ~3 us more.
def _turn(ids: bytes | np.ndarray, *fields: Any) -> Turn:
    return Turn(ids_from_wire(ids), *fields)


def _turn_result(status: str | None, *fields: Any) -> TurnResult:
    text, reply, reward_signals, error, error_details, ids = fields
    return TurnResult(
        status=None if status is None else RolloutStatus(status),
        text=text,
        reply=reply,
        reward_signals=reward_signals,
        error=error,
        error_details=error_details,
        continuation=ids_from_wire(ids),
    )


async def take_turn(
    env: MessageEnv,
    turn: Turn,
    renderer: Renderer,
    step: Callable[[MessageEnv, str], Awaitable[Any]],
) -> TurnResult:
    """Parse, step (`step(env, text)`, which raises the env's failures as EnvCallFailed,
    TimeoutError with its line past its bound), check and render."""
    try:
        text = renderer.parse_completion(turn.completion_ids)
    except ValueError as e:  # the renderer's word for a completion it cannot parse
        return TurnResult(status=RolloutStatus.ERROR_PARSE, error=describe_exception(e))
    except Exception as e:  # a decoder's own failure (a KeyError) ends the rollout, not the run
        error = renderer_raised(renderer, "parse_completion", turn.index, e)
        return TurnResult(
            status=RolloutStatus.ERROR_PARSE, error=error, error_details=traceback.format_exc()
        )
    if turn.cut:
        return TurnResult(status=RolloutStatus.TRUNCATED_LENGTH, text=text)
    try:
        result = await step(env, text)
    except TimeoutError as e:
        return TurnResult(status=RolloutStatus.ERROR_TIMEOUT, text=text, error=str(e))
    except EnvCallFailed as e:  # a user env failing is recorded on the rollout, not fatal
        return TurnResult(
            status=RolloutStatus.ERROR_ENV, text=text, error=e.error, error_details=e.details
        )
    where = f"{type(env).__name__}.step (turn {turn.index})"
    try:
        if not isinstance(result, StepResult):
            raise ValueError(f"{where} returned {result!r}; it must return a StepResult")
        reply = checked_messages(result.messages, where)
        signals = _checked_signals(result.reward_signals, where)
    except ValueError as e:
        return TurnResult(status=RolloutStatus.ERROR_ENV, text=text, error=str(e))
    outcome = TurnResult(status=None, text=text, reply=reply, reward_signals=signals)
    if result.done:
        outcome.status = RolloutStatus.COMPLETED
    elif turn.last:
        outcome.status = RolloutStatus.TRUNCATED_TURNS
    else:
        try:
            outcome.continuation = renderer.render_continuation(reply, turn.closed)
        except Exception as e:  # a reply the tokenizer refuses ends the rollout, not the run
            outcome.status = RolloutStatus.ERROR_ENV
            outcome.error = renderer_raised(renderer, "render_continuation", turn.index, e)
            outcome.error_details = traceback.format_exc()
    return outcome


def renderer_raised(renderer: Renderer, method: str, index: int, e: Exception) -> str:
    """The error line of a renderer's `method` raising `e` in assistant turn `index`."""
    return f"{type(renderer).__name__}.{method} (turn {index}) raised {describe_exception(e)}"


def _checked_signals(signals: Any, where: str) -> dict[str, float]:
    """`signals` as a dict, or ValueError naming `where` (dict() of a None raises TypeError)."""
    try:
        return dict(signals)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{where} gave reward_signals {signals!r}; expected a dict of floats"
        ) from e


def checked_messages(messages: Any, where: str) -> list[Message]:
    """`messages` as a list, or ValueError naming `where` and the first bad message: each is
    a dict with str "role" and "content" that UTF-8 can encode (a lone surrogate cannot)."""
    if not isinstance(messages, list | tuple):
        raise ValueError(f"{where} gave {type(messages).__name__} messages; expected a list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not all(
            isinstance(message.get(k), str) for k in ("role", "content")
        ):
            raise ValueError(f"{where}: message {i} is {message!r}; expected str role and content")
        for key in ("role", "content"):
            try:
                message[key].encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"{where}: message {i} {key} has a lone surrogate "
                    f"{message[key][e.start]!r} at index {e.start}, which UTF-8 cannot encode"
                ) from e
    return list(messages)
