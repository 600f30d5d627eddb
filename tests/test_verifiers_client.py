"""Our GenerateFn behind verifiers 0.4.0's Client: verifiers' own request parsing and
Response types, and the tokens it reports are exactly the ones generated, turn after turn."""

import asyncio

import numpy as np
import pytest

pytest.importorskip("verifiers.v1")

from fakes import IM_END, FakeRenderer, ScriptedGenerate, encode, make_completion  # noqa: E402
from verifiers.v1.dialects import ChatDialect  # noqa: E402
from verifiers.v1.errors import ProviderError  # noqa: E402
from verifiers.v1.types import SamplingConfig  # noqa: E402

from torchtitan_rl.envs.verifiers_client import GenerateFnClient  # noqa: E402
from torchtitan_rl.types import FinishReason, SamplingParams  # noqa: E402

ODD = 300
"""A token id the fake renderer never writes and parse_completion drops: a prompt that holds
it was built from the sampled ids, not from the text re-tokenized."""


SESSION = "step=1/group=2/rollout=3"


def _client(respond, max_rollout_tokens=512):
    generate = ScriptedGenerate(respond)
    sampling = SamplingParams(temperature=1.0, max_tokens=32, seed=0, stop_token_ids=(IM_END,))
    client = GenerateFnClient(
        generate,
        FakeRenderer(),
        sampling,
        session_id=SESSION,
        seed_of_turn=lambda turn: 100 + turn,
        max_rollout_tokens=max_rollout_tokens,
    )
    client.name_trace("s", agent="player", trained=True)
    return client, generate


def _ask(client, messages, max_tokens=None, session="s", tools=None):
    body = {"model": "policy", "messages": messages}
    if tools:
        body["tools"] = tools
    sampling = SamplingConfig(max_tokens=max_tokens)
    return asyncio.run(client.get_response(ChatDialect(), body, sampling, session_id=session))


def _answer(text, request_id, **kw):
    return make_completion([*encode(text), ODD, IM_END], request_id=request_id, **kw)


def test_a_single_turn_reports_the_rendered_prompt_and_the_sampled_ids_and_logprobs():
    client, generate = _client(lambda call: _answer("42", call.request_id))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "6*7?"}]
    response = _ask(client, messages, max_tokens=8)
    completion = make_completion([*encode("42"), ODD, IM_END])
    assert response.message.content == "42" and response.finish_reason == "stop"
    assert response.tokens.prompt_ids == FakeRenderer().render_prompt(messages).tolist()
    assert response.tokens.completion_ids == completion.token_ids_N.tolist()
    assert response.tokens.completion_logprobs == completion.logprobs_N.tolist()
    call = generate.calls[0]
    assert call.sampling.max_tokens == 8  # the request can lower max_tokens
    assert call.session_id == SESSION and call.request_id == f"{SESSION}/turn=0"
    assert call.sampling.seed == 100  # seed_of_turn(0): the Rollouter's seed of the turn


def test_another_agents_requests_are_named_and_seeded_apart_from_the_trained_agents():
    client, generate = _client(lambda call: _answer("ok", call.request_id))
    client.name_trace("u", agent="user", trained=False)
    _ask(client, [{"role": "user", "content": "q"}], session="u")
    _ask(client, [{"role": "user", "content": "q"}], session="s")
    user, trained = generate.calls
    assert user.request_id == f"{SESSION}/user/turn=0" and user.session_id == SESSION
    assert trained.request_id == f"{SESSION}/turn=0" and trained.sampling.seed == 100
    assert user.sampling.seed != trained.sampling.seed
    assert [len(client.turns(s)) for s in ("u", "s")] == [1, 1]


def test_max_tokens_is_capped_by_what_is_left_of_the_rollout_budget():
    messages = [{"role": "user", "content": "q"}]
    prompt = len(FakeRenderer().render_prompt(messages))
    client, generate = _client(lambda call: _answer("a", call.request_id), prompt + 5)
    _ask(client, messages)
    assert generate.calls[0].sampling.max_tokens == 5
    client, _ = _client(lambda call: _answer("a", call.request_id), prompt)
    with pytest.raises(ProviderError, match="leaves no room to generate under env.max_rollout"):
        _ask(client, messages)


def test_a_second_turn_extends_the_first_with_its_sampled_ids():
    client, _ = _client(lambda call: _answer(f"a{call.request_id[-1]}", call.request_id))
    first = [{"role": "user", "content": "q"}]
    r0 = _ask(client, first)
    second = [*first, {"role": "assistant", "content": "a0"}, {"role": "user", "content": "more"}]
    r1 = _ask(client, second)
    renderer = FakeRenderer()
    expected = [
        *r0.tokens.prompt_ids,
        *r0.tokens.completion_ids,  # holds ODD: the sampled ids, not the text again
        *renderer.render_continuation(second[2:], True).tolist(),
    ]
    assert r1.tokens.prompt_ids == expected and ODD in r1.tokens.prompt_ids
    turns = client.turns("s")
    assert [t.assistant_text for t in turns] == ["a0", "a1"]
    assert turns[0].env_messages == [{"role": "user", "content": "more"}]
    assert np.array_equal(turns[1].prompt_ids, expected)
    assert turns[1].completion.token_ids_N.tolist() == r1.tokens.completion_ids


def test_a_turn_ended_by_a_stop_sequence_gets_its_closing_token_in_the_next_prompt():
    """rollout.stop ends a turn without a stop token: the next prompt closes it, as
    `render_prompt` of the whole history would."""
    client, _ = _client(lambda call: make_completion([*encode("a0")], request_id=call.request_id))
    first = [{"role": "user", "content": "q"}]
    r0 = _ask(client, first)
    second = [*first, {"role": "assistant", "content": "a0"}, {"role": "user", "content": "more"}]
    r1 = _ask(client, second)
    tail = FakeRenderer().render_continuation(second[2:], False).tolist()
    assert tail[0] == IM_END
    assert r1.tokens.prompt_ids == [*r0.tokens.prompt_ids, *r0.tokens.completion_ids, *tail]


def test_a_rewritten_history_is_rendered_afresh():
    client, _ = _client(lambda call: _answer("x", call.request_id))
    _ask(client, [{"role": "user", "content": "q"}])
    edited = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "y"},  # not what was sampled
        {"role": "user", "content": "again"},
    ]
    response = _ask(client, edited)
    assert response.tokens.prompt_ids == FakeRenderer().render_prompt(edited).tolist()


def test_a_failed_generation_and_a_tool_call_are_provider_errors():
    client, _ = _client(
        lambda call: make_completion([], finish_reason=FinishReason.ERROR, request_id="r")
    )
    with pytest.raises(ProviderError, match=f"generator failed on {SESSION}/turn=0"):
        _ask(client, [{"role": "user", "content": "q"}])
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    with pytest.raises(ProviderError, match="text messages only"):
        _ask(client, history)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with pytest.raises(ProviderError, match="this request defines tools"):
        _ask(client, [{"role": "user", "content": "q"}], tools=[tool])
