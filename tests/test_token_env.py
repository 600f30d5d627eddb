import asyncio

import numpy as np
import pytest
from fakes import IM_END, FakeRenderer, Hang, ScriptedEnv, done, make_completion, reply

from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.rollout.env_calls import LocalCalls
from torchtitan_rl.rollout.token_env import TokenEnv, TokenEnvError
from torchtitan_rl.types import FinishReason, RolloutStatus


def make_env(script, *, max_turns=4, max_rollout_tokens=1000, step_timeout_s=5.0, **kw):
    config = EnvConfig(
        max_turns=max_turns, max_rollout_tokens=max_rollout_tokens, step_timeout_s=step_timeout_s
    )
    return TokenEnv(ScriptedEnv(script, **kw), FakeRenderer(), config)


def run(coro):
    return asyncio.run(coro)


def test_next_prompt_is_prompt_plus_sampled_ids_plus_continuation():
    async def go():
        env = make_env([reply("again", score=0.5), done()])
        prompt = await env.reset()
        # 200 alone is not valid UTF-8: parsing then re-encoding would change the ids
        sampled = [200, 65, IM_END]
        result = await env.step(make_completion(sampled))
        return prompt, result

    prompt, result = run(go())
    continuation = FakeRenderer().render_continuation([{"role": "user", "content": "again"}], True)
    expected = np.concatenate([prompt, np.array([200, 65, IM_END], np.int32), continuation])
    np.testing.assert_array_equal(result.next_prompt_ids, expected)
    assert result.next_prompt_ids.dtype == np.int32
    assert not result.done and result.status is None
    assert result.env_messages == [{"role": "user", "content": "again"}]
    assert result.reward_signals == {"score": 0.5}


def test_a_turn_ended_by_a_stop_sequence_gets_its_closing_token_in_the_continuation():
    async def go():
        env = make_env([reply("again"), done()])
        prompt = await env.reset()
        sampled = [65, 33]  # "A!" ended by the stop sequence "!": no stop token sampled
        return prompt, await env.step(make_completion(sampled, finish_reason=FinishReason.STOP))

    prompt, result = run(go())
    continuation = FakeRenderer().render_continuation([{"role": "user", "content": "again"}], False)
    assert continuation[0] == IM_END
    expected = np.concatenate([prompt, np.array([65, 33], np.int32), continuation])
    np.testing.assert_array_equal(result.next_prompt_ids, expected)


def test_env_done_completes_rollout_without_next_prompt():
    async def go():
        env = make_env([done()])
        await env.reset()
        return env, await env.step(make_completion([65, IM_END]))

    env, result = run(go())
    assert result.done and result.status is RolloutStatus.COMPLETED
    assert result.next_prompt_ids is None
    assert result.assistant_text == "A"
    assert env.messages[-1] == {"role": "assistant", "content": "A"}


def test_length_finish_truncates_without_stepping_env():
    async def go():
        env = make_env([])  # stepping the env would raise IndexError
        await env.reset()
        return await env.step(make_completion([65, 66], finish_reason=FinishReason.LENGTH))

    result = run(go())
    assert result.status is RolloutStatus.TRUNCATED_LENGTH and result.done
    assert result.assistant_text == "AB"


def test_max_turns_truncates_when_env_not_done():
    async def go():
        env = make_env([reply("more"), reply("more")], max_turns=2)
        await env.reset()
        first = await env.step(make_completion([65, IM_END]))
        second = await env.step(make_completion([66, IM_END]))
        return first, second

    first, second = run(go())
    assert not first.done
    assert second.status is RolloutStatus.TRUNCATED_TURNS
    assert second.env_messages == [{"role": "user", "content": "more"}]


def test_next_prompt_over_token_budget_truncates_prompt():
    async def go():
        env = make_env([reply("x" * 50)], max_rollout_tokens=40)
        await env.reset()
        return await env.step(make_completion([65, IM_END]))

    assert run(go()).status is RolloutStatus.TRUNCATED_PROMPT


def test_env_exception_is_error_env_with_message():
    async def go():
        env = make_env([RuntimeError("board on fire")])
        await env.reset()
        return await env.step(make_completion([65, IM_END]))

    result = run(go())
    assert result.status is RolloutStatus.ERROR_ENV
    assert "RuntimeError" in result.error and "board on fire" in result.error


def test_slow_env_step_is_error_timeout():
    async def go():
        env = make_env([Hang(10.0)], step_timeout_s=0.05)
        await env.reset()
        return await env.step(make_completion([65, IM_END]))

    result = run(go())
    assert result.status is RolloutStatus.ERROR_TIMEOUT
    assert result.error == "env.step exceeded env.step_timeout_s=0.05"
    assert result.assistant_text == "A"


def test_a_timeout_error_the_env_raises_itself_is_its_failure_not_the_bound():
    """Its own client's deadline (an HTTP 504) at once, far inside env.step_timeout_s: the
    env's failure with its traceback, not a line saying the bound ran out."""

    async def step():
        env = make_env([TimeoutError("the sandbox's own deadline")], step_timeout_s=30.0)
        await env.reset()
        return await env.step(make_completion([65, IM_END]))

    async def init():
        await make_env([], init_error=TimeoutError("db connect")).reset()

    result = run(step())
    assert (result.status, result.error) == (
        RolloutStatus.ERROR_ENV,
        "TimeoutError: the sandbox's own deadline",
    )
    assert "raise item" in result.error_details and result.assistant_text == "A"
    with pytest.raises(TokenEnvError) as info:
        run(init())
    assert (info.value.status, str(info.value)) == (
        RolloutStatus.ERROR_ENV,
        "TimeoutError: db connect",
    )


class CountingRenderer(FakeRenderer):
    parsed = 0

    def parse_completion(self, token_ids):
        self.parsed += 1
        return super().parse_completion(token_ids)


class KilledTurnCalls(LocalCalls):
    """EnvCalls whose turns end as a worker killed mid-turn does: TimeoutError with a line."""

    async def turn(self, env, turn):
        raise TimeoutError("the turn ran past env.step_timeout_s=5.0 in a killed worker")


def test_a_turn_whose_worker_was_killed_is_error_timeout_and_is_not_parsed_again():
    """What the killed worker ran may never end: the completion is not parsed on this loop
    to learn its text, the line from the EnvCalls is the rollout's error."""
    renderer = CountingRenderer()
    config = EnvConfig(max_turns=4, max_rollout_tokens=1000, step_timeout_s=5.0)
    env = TokenEnv(ScriptedEnv([done()]), renderer, config, KilledTurnCalls(5.0, None, renderer))

    async def go():
        await env.reset()
        return await env.step(make_completion([65, IM_END]))

    result = run(go())
    assert result.status is RolloutStatus.ERROR_TIMEOUT and result.done
    assert result.error == "the turn ran past env.step_timeout_s=5.0 in a killed worker"
    assert (result.assistant_text, renderer.parsed) == ("", 0)
    assert env.messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "completion",
    [
        None,
        make_completion([], finish_reason=FinishReason.ERROR),
        make_completion([65], finish_reason=FinishReason.ABORT),
    ],
)
def test_missing_or_failed_completion_is_error_generator(completion):
    async def go():
        env = make_env([done()])
        await env.reset()
        return await env.step(completion)

    result = run(go())
    assert result.status is RolloutStatus.ERROR_GENERATOR and result.done


def test_init_failure_raises_token_env_error_with_status():
    async def go():
        await make_env([], init_error=KeyError("no sample")).reset()

    with pytest.raises(TokenEnvError) as info:
        run(go())
    assert info.value.status is RolloutStatus.ERROR_ENV


@pytest.mark.parametrize(
    "result, error",
    [
        (None, "ScriptedEnv.step (turn 1) returned None; it must return a StepResult"),
        (
            reply("ok \ud800!"),
            "ScriptedEnv.step (turn 1): message 0 content has a lone surrogate '\\ud800' at "
            "index 3, which UTF-8 cannot encode",
        ),
    ],
)
def test_a_step_result_the_env_got_wrong_is_error_env_naming_env_method_and_index(result, error):
    async def go():
        env = make_env([reply("again"), result])
        await env.reset()
        await env.step(make_completion([65, IM_END]))
        return await env.step(make_completion([66, IM_END]))

    step = run(go())
    assert step.done and step.status is RolloutStatus.ERROR_ENV
    assert step.error == error and step.assistant_text == "B"


def test_a_lone_surrogate_in_the_first_prompt_is_error_env_at_reset():
    with pytest.raises(TokenEnvError) as info:
        run(make_env([], first="hi \udc80").reset())
    assert info.value.status is RolloutStatus.ERROR_ENV
    assert str(info.value) == (
        "ScriptedEnv.init: message 0 content has a lone surrogate '\\udc80' at index 3, "
        "which UTF-8 cannot encode"
    )
