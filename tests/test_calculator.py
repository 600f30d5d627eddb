"""Calculator: a multi-turn tool env; the tool is safe, the score exact, metrics recorded."""

import asyncio

import pytest

from torchtitan_rl.config import load_config
from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.envs.calculator import (
    Calculator,
    CalculatorConfig,
    answer_of,
    tool_reply,
)
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.models.tokenizer import Tokenizer
from torchtitan_rl.types import Completion, FinishReason, Rollout, RolloutTurn

SAMPLE = {"a": 417, "op": "*", "b": 238}


def _env(seed=0, max_turns=3, **args):
    return Calculator(EnvConfig(max_turns=max_turns), seed, CalculatorConfig(**args))


def _play(env, sample, replies):
    """Plays `replies` in order; returns (env replies, rollout with the turns' signals)."""
    played = env.make_env(sample)
    asyncio.run(played.init())
    rollout = Rollout(group_id=0, rollout_id=0, session_id="s", sample=sample)
    said = []
    for reply in replies:
        result = asyncio.run(played.step(reply))
        completion = Completion(
            request_id="r", token_ids_N=[], logprobs_N=[], finish_reason=FinishReason.STOP
        )
        rollout.turns.append(
            RolloutTurn(
                prompt_ids=[], completion=completion, assistant_text=reply,
                env_messages=result.messages, reward_signals=result.reward_signals,
            )
        )  # fmt: skip
        said += [m["content"] for m in result.messages]
        if result.done:
            break
    else:
        raise AssertionError("the rollout did not end")
    scores = env.rubric().score(rollout)[1]
    return said, scores


def test_the_demonstration_uses_the_tool_and_scores_one():
    env = _env()
    for i in range(20):
        sample = env.train_sample(i)
        demo = env.demonstration(sample)
        said, scores = _play(env, sample, [m["content"] for m in demo if m["role"] == "assistant"])
        assert said == [demo[2]["content"]] == [f"result: {answer_of(sample)}"]
        assert scores == {"calculator_score": 1.0, "tool_calls": 1.0, "used_tool": 1.0}


@pytest.mark.parametrize(
    "replies, said, scores",
    [
        (["<answer>99246</answer>"], [], (1.0, 0.0, 0.0)),  # right without the tool
        (["<calc>417*238</calc>", "<answer>99245</answer>"], ["result: 99246"], (0.0, 1.0, 1.0)),
        (["I do not know"], [], (0.0, 0.0, 0.0)),  # neither a call nor an answer
        (
            ["<calc>1+1</calc>", "<calc>2+2</calc>", "<calc>417*238</calc>"],
            ["result: 2", "result: 4"],
            (0.0, 2.0, 1.0),  # the third call is over max_tool_calls = 2: ends with 0
        ),
    ],
)
def test_rollouts_score_as_documented(replies, said, scores):
    got_said, got = _play(_env(), SAMPLE, replies)
    assert got_said == said
    assert (got["calculator_score"], got["tool_calls"], got["used_tool"]) == scores


@pytest.mark.parametrize(
    "expression, reply",
    [
        ("417 * 238", "result: 99246"),
        ("(2+3)*4-1", "result: 19"),
        ("__import__('os').system('x')", "error: Call is not allowed"),
        ("9**9**9", "error: operator Pow is not allowed"),
        ("10**13", "error: operator Pow is not allowed"),
        ("9999999*9999999", "error: value out of range"),
        ("1/0", "error: operator Div is not allowed"),
        ("", "error: empty expression"),
        ("４+1", "error: not an expression"),
        ("1+" * 300 + "1", "error: longer than 200 characters"),
    ],
)
def test_the_tool_is_safe(expression, reply):
    assert tool_reply(expression).startswith(reply.split(" is ")[0]), tool_reply(expression)


def test_a_truncated_rollout_scores_zero_and_max_turns_must_leave_an_answer_turn():
    env = _env()
    empty = Rollout(group_id=0, rollout_id=0, session_id="s", sample=SAMPLE)
    assert env.rubric().score(empty)[0] == 0.0
    with pytest.raises(ValueError, match="env.max_turns=2"):
        _env(max_turns=2)


def test_splits_are_disjoint_and_deterministic():
    env = _env()
    train = {tuple(env.train_sample(i).values()) for i in range(400)}
    validation = {tuple(s.values()) for s in env.validation_samples(64)}
    assert not train & validation
    assert env.train_sample(5) == _env().train_sample(5) != _env(seed=1).train_sample(5)


def test_the_config_runs_calculator_and_its_demonstrations_fit():
    config = load_config("train_configs/calculator_tiny.toml")
    assert config.env.name == "calculator" and config.env.max_turns == 3
    env = Calculator(config.env, 0, config.env_args())
    renderer = Renderer(Tokenizer.from_file(None))
    longest = max(
        len(renderer.render_prompt(env.demonstration(env.train_sample(i)))) for i in range(200)
    )
    assert longest <= min(config.batcher.seq_len, config.env.max_rollout_tokens)
