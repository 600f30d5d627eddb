"""Our generator behind verifiers 0.4.0's model client, with the exact tokens it sampled.

verifiers 0.4.0 (`verifiers.v1`) plays an episode as an agent program that asks an
OpenAI-compatible endpoint (its interception server) for each completion; the server hands
every request to a `verifiers.v1.Client`: `get_response(dialect, body, sampling, session_id,
turn) -> Response`, where `session_id` is the id of the agent's trace. `GenerateFnClient` is
that client over a `GenerateFn` for one of our rollouts, building prompts the way `TokenEnv`
does, so a trained turn is exactly what was generated:

    turn 0: prompt_0 = render_prompt(messages)
    turn 1: prompt_1 = prompt_0 + A0 + render_continuation(tail)   (tail: the messages after
            the assistant reply that matches A0's text; a rewritten history renders afresh)

`Response.tokens` carries (prompt_1, A1 ids, A1 log-probs) and `turns(trace_id)` gives the
trace's `RolloutTurn`s (each with its `Completion`: ids, generator log-probs, policy
versions), never text re-tokenized. Requests are named as the Rollouter names them: the
trained agent's turn T is `{session_id}/turn={T}` with seed `seed_of_turn(T)`; another agent
of the episode (say a simulated user) is `{session_id}/{agent}/turn={T}` with a seed derived
from both. Every turn's max_tokens is capped by what is left of `max_rollout_tokens`.
Chat-completions requests with text messages only (no tool definitions, no tool calls).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from verifiers.v1 import Client
from verifiers.v1.clients.train import serialize_completion
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import ProviderError
from verifiers.v1.types import AssistantMessage, Response, TurnTokens, Usage

from torchtitan_rl.types import (
    Completion,
    FinishReason,
    GenerateFn,
    Message,
    RolloutTurn,
    SamplingParams,
)

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
"""Our finish reasons as verifiers' (OpenAI's); any other is a provider error."""
_SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class _Turn:
    messages: list[Message]
    """The request's messages (the prompt), as {"role", "content"}."""
    prompt_ids: np.ndarray
    completion: Completion
    text: str


@dataclass(slots=True)
class _Session:
    """One verifiers trace (one agent's run) of the rollout."""

    label: str
    """"" for the trained agent, else "{agent}/" (request ids and seeds tell them apart);
    "{trace id}/" for a trace never named."""
    turns: list[_Turn] = field(default_factory=list)


class GenerateFnClient(Client):
    """A verifiers `Client` whose completions come from `generate_fn`, for one rollout.

    `sampling` is the template of every request (our temperature and top-p/top-k, so the
    generator's log-probs are those of the distribution the loss assumes); a request's
    `max_tokens` can only lower its `max_tokens`.
    """

    def __init__(
        self,
        generate_fn: GenerateFn,
        renderer: Any,
        sampling: SamplingParams,
        *,
        session_id: str,
        seed_of_turn: Callable[[int], int],
        max_rollout_tokens: int,
    ):
        self.generate_fn = generate_fn
        self.renderer = renderer
        self.sampling = sampling
        self.session_id = session_id
        self.seed_of_turn = seed_of_turn
        self.max_rollout_tokens = max_rollout_tokens
        self._sessions: dict[str, _Session] = {}

    def name_trace(self, trace_id: str, *, agent: str, trained: bool) -> None:
        """Say whose trace `trace_id` is, before its first request (verifiers' `on_trace`)."""
        label = "" if trained else f"{agent}/"
        taken = sum(s.label == label for s in self._sessions.values())
        if taken:  # a second trained trace, or a retried agent: keep request ids unique
            label = f"{agent}#{taken}/"
        self._sessions[trace_id] = _Session(label)

    def turns(self, trace_id: str) -> list[RolloutTurn]:
        """The trace's turns in order; each turn's env reply is the tail the next request
        added after it."""
        played = self._sessions[trace_id].turns if trace_id in self._sessions else []
        out = []
        for i, turn in enumerate(played):
            reply: list[Message] = []
            if i + 1 < len(played):
                reply = played[i + 1].messages[len(turn.messages) + 1 :]
            out.append(
                RolloutTurn(
                    prompt_ids=turn.prompt_ids,
                    completion=turn.completion,
                    assistant_text=turn.text,
                    env_messages=reply,
                )
            )
        return out

    async def get_response(
        self,
        dialect: Any,
        body: dict,
        sampling: Any,
        session_id: str | None = None,
        turn: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        if not isinstance(dialect, ChatDialect):
            raise NotImplementedError(
                f"GenerateFnClient serves chat completions only, got {type(dialect).__name__}"
            )
        if body.get("tools") or (turn is not None and turn.tools):
            raise ProviderError(
                "GenerateFnClient renders text chats only; this request defines tools",
                status_code=400,
            )
        prompt = turn.prompt if turn is not None else dialect.parse_request(body).messages
        messages = [_text_message(message_to_wire(m)) for m in prompt]
        session = self._sessions.setdefault(session_id or "", _Session(f"{session_id}/"))
        index = len(session.turns)
        request_id = f"{self.session_id}/{session.label}turn={index}"
        prompt_ids = self._prompt_ids(session.turns, messages)
        room = self.max_rollout_tokens - len(prompt_ids)
        if room < 1:
            raise ProviderError(
                f"the prompt of {request_id} ({len(prompt_ids)} tokens) leaves no room to "
                f"generate under env.max_rollout_tokens={self.max_rollout_tokens}",
                status_code=400,
            )
        limits = [self.sampling.max_tokens, room]
        if sampling.max_tokens is not None:
            limits.append(sampling.max_tokens)
        seed = self.seed_of_turn(index)
        if session.label:
            seed = _derived_seed(seed, session.label)
        params = replace(self.sampling, max_tokens=min(limits), seed=seed)
        completion = await self.generate_fn(
            prompt_ids, request_id=request_id, session_id=self.session_id, sampling=params
        )
        if completion is None or completion.finish_reason not in FINISH:
            why = "no completion" if completion is None else completion.error
            # an invalid request fails again: a 4xx, which the chat program does not retry
            invalid = completion is not None and completion.finish_reason == FinishReason.ERROR
            raise ProviderError(
                f"generator failed on {request_id}: {why}", status_code=400 if invalid else 502
            )
        text = self.renderer.parse_completion(completion.token_ids_N)
        session.turns.append(_Turn(messages, prompt_ids, completion, text))
        return _response(request_id, body, prompt_ids, completion, text)

    def _prompt_ids(self, played: list[_Turn], messages: list[Message]) -> np.ndarray:
        """The last turn's prompt + its sampled ids + the new tail, when `messages` extend that
        turn's messages by its reply; otherwise (first turn, rewritten history) a fresh render."""
        if played:
            last = played[-1]
            head = [*last.messages, {"role": "assistant", "content": last.text}]
            if messages[: len(head)] == head and len(messages) > len(head):
                stopped = self.renderer.closed_by_stop_token(last.completion)
                tail = self.renderer.render_continuation(messages[len(head) :], stopped)
                ids = [last.prompt_ids, last.completion.token_ids_N, np.asarray(tail)]
                return np.concatenate(ids).astype(np.int32)
        return np.asarray(self.renderer.render_prompt(messages), np.int32)


def _response(
    request_id: str, body: dict, prompt_ids: np.ndarray, completion: Completion, text: str
) -> Response:
    ids_N = completion.token_ids_N
    response = Response(
        id=request_id,
        created=0,
        model=body.get("model", ""),
        message=AssistantMessage(content=text),
        finish_reason=FINISH[completion.finish_reason],
        usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(ids_N)),
        tokens=TurnTokens(
            prompt_ids=prompt_ids.tolist(),
            completion_ids=ids_N.tolist(),
            completion_logprobs=completion.logprobs_N.tolist(),
        ),
    )
    response.raw = serialize_completion(response, response.model)
    return response


def _derived_seed(seed: int, label: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{label}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def _text_message(wire: dict) -> Message:
    content = wire.get("content")
    if wire.get("tool_calls") or not isinstance(content, str):
        raise ProviderError(
            f"GenerateFnClient renders text messages only, got a {wire.get('role')} message "
            "with tool calls or non-text content",
            status_code=400,
        )
    return {"role": wire["role"], "content": content}
