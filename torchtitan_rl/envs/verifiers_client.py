"""Our generator behind verifiers 0.4.0's model client, with the exact tokens it sampled.

verifiers 0.4.0 (`verifiers.v1`) plays an episode as an agent program that asks an
OpenAI-compatible endpoint (its interception server) for each completion; the server hands
every request to a `verifiers.v1.Client`: `get_response(dialect, body, sampling, session_id,
turn) -> Response`. `GenerateFnClient` is that client over a `GenerateFn`, building prompts the
way `TokenEnv` does, so a trained turn is exactly what was generated:

    turn 0: prompt_0 = render_prompt(messages)
    turn 1: prompt_1 = prompt_0 + A0 + render_continuation(tail)   (tail: the messages after
            the assistant reply that matches A0's text; a rewritten history renders afresh)

`Response.tokens` carries (prompt_1, A1 ids, A1 log-probs) and `turns(session_id)` gives the
session's `RolloutTurn`s (each with its `Completion`: ids, generator log-probs, policy
versions), never text re-tokenized.

Not wired yet (what running a verifiers environment end to end still needs): the
interception server builds its client from a config (`resolve_client`), so this instance
must be handed to it; every episode runs the agent program in a uv-managed environment
(`uv sync --script`, the program's own openai/mcp dependencies); the Rollouter plays
`MessageEnv`s, so an episode driven by verifiers (its Env, its rubric's reward) needs a
second rollout path that turns `turns(session_id)` and the episode's reward into a Rollout.
Chat-completions requests with text messages only (no tool calls, no images).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
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


@dataclass(slots=True)
class _Turn:
    messages: list[Message]
    """The request's messages (the prompt), as {"role", "content"}."""
    prompt_ids: np.ndarray
    completion: Completion
    text: str


class GenerateFnClient(Client):
    """A verifiers `Client` whose completions come from `generate_fn`.

    `sampling` is the template of every request (our temperature and top-p/top-k, so the
    generator's log-probs are those of the distribution the loss assumes); a request's
    `max_tokens` can only lower its `max_tokens`.
    """

    def __init__(self, generate_fn: GenerateFn, renderer: Any, sampling: SamplingParams):
        self.generate_fn = generate_fn
        self.renderer = renderer
        self.sampling = sampling
        self._sessions: dict[str, list[_Turn]] = {}

    def turns(self, session_id: str) -> list[RolloutTurn]:
        """The session's turns in order; each turn's env reply is the tail the next request
        added after it."""
        played = self._sessions.get(session_id, [])
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
        prompt = turn.prompt if turn is not None else dialect.parse_request(body).messages
        messages = [_text_message(message_to_wire(m)) for m in prompt]
        session = session_id or "no-session"
        played = self._sessions.setdefault(session, [])
        prompt_ids = self._prompt_ids(played, messages)
        params = self.sampling
        if sampling.max_tokens is not None:
            params = replace(params, max_tokens=min(params.max_tokens, sampling.max_tokens))
        request_id = f"{session}/turn={len(played)}"
        completion = await self.generate_fn(
            prompt_ids, request_id=request_id, session_id=session, sampling=params
        )
        if completion is None or completion.finish_reason not in FINISH:
            why = "no completion" if completion is None else completion.error
            raise ProviderError(f"generator failed on {request_id}: {why}", status_code=502)
        text = self.renderer.parse_completion(completion.token_ids_N)
        played.append(_Turn(messages, prompt_ids, completion, text))
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

    def _prompt_ids(self, played: list[_Turn], messages: list[Message]) -> np.ndarray:
        """The last turn's prompt + its sampled ids + the new tail, when `messages` extend that
        turn's messages by its reply; otherwise (first turn, rewritten history) a fresh render."""
        if played:
            last = played[-1]
            head = [*last.messages, {"role": "assistant", "content": last.text}]
            if messages[: len(head)] == head and len(messages) > len(head):
                stopped = last.completion.finish_reason == FinishReason.STOP
                tail = self.renderer.render_continuation(messages[len(head) :], stopped)
                ids = [last.prompt_ids, last.completion.token_ids_N, np.asarray(tail)]
                return np.concatenate(ids).astype(np.int32)
        return np.asarray(self.renderer.render_prompt(messages), np.int32)


def _text_message(wire: dict) -> Message:
    content = wire.get("content")
    if wire.get("tool_calls") or not isinstance(content, str):
        raise ProviderError(
            f"GenerateFnClient renders text messages only, got a {wire.get('role')} message "
            "with tool calls or non-text content",
            status_code=400,
        )
    return {"role": wire["role"], "content": content}
