"""Calculator: a multi-turn tool env; the tool is safe, the score exact, metrics recorded."""

import asyncio

import numpy as np
import pytest

from torchtitan_rl.config import load_config
from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.envs.calculator import (
    CALLED,
    SCORE,
    Calculator,
    CalculatorConfig,
    answer_of,
    tool_reply,
)
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.models.tokenizer import Tokenizer
from torchtitan_rl.types import Completion, FinishReason, Rollout, RolloutTurn

SAMPLE = {"a": 417, "op": "*", "b": 238}
CONFIG = "train_configs/calculator_tiny.toml"


def make_env(seed: int = 0, max_turns: int = 3, **args) -> Calculator:
    return Calculator(EnvConfig(max_turns=max_turns), seed, CalculatorConfig(**args))


def turn_with(reply: str, signals: dict[str, float]) -> RolloutTurn:
    completion = Completion(
        request_id="r",
        token_ids_N=np.zeros(1, dtype=np.int32),
        logprobs_N=np.zeros(1, dtype=np.float32),
        finish_reason=FinishReason.STOP,
    )
    return RolloutTurn(
        prompt_ids=np.zeros(1, dtype=np.int32),
        completion=completion,
        assistant_text=reply,
        reward_signals=signals,
    )


def play(environment: Calculator, sample: dict, replies: list[str]) -> tuple[list[str], dict]:
    """Plays `replies` until the env ends the rollout; (env replies, rubric breakdown)."""
    env = environment.make_env(sample)
    rollout = Rollout(group_id=0, rollout_id=0, session_id="s", sample=sample)

    async def run() -> list[str]:
        first = await env.init()
        assert [m["role"] for m in first] == ["user"]
        said = []
        for reply in replies:
            result = await env.step(reply)
            rollout.turns.append(turn_with(reply, result.reward_signals))
            assert all(m["role"] == "user" for m in result.messages)
            said += [m["content"] for m in result.messages]
            if result.done:
                assert result.messages == []
                return said
        raise AssertionError("the rollout did not end")

    said = asyncio.run(run())
    return said, environment.rubric().score(rollout)[1]


def test_demonstrations_use_the_tool_once_and_score_one():
    environment = make_env()
    for index in range(20):
        sample = environment.train_sample(index)
        demo = environment.demonstration(sample)
        assert [m["role"] for m in demo] == ["user", "assistant"] * 2
        replies = [m["content"] for m in demo if m["role"] == "assistant"]
        said, scores = play(environment, sample, replies)
        assert said == [demo[2]["content"]] == [f"result: {answer_of(sample)}"]
        assert scores == {"calculator_score": 1.0, "tool_calls": 1.0, "used_tool": 1.0}


def test_worked_example():
    demo = make_env().demonstration(SAMPLE)
    assert [m["content"] for m in demo] == [
        "What is 417 * 238? Call <calc>expression</calc>; answer in <answer> tags.",
        "<calc>417*238</calc>",
        "result: 99246",
        "<answer>99246</answer>",
    ]


@pytest.mark.parametrize(
    ("replies", "said", "scores"),
    [
        (["<answer>99246</answer>"], [], (1.0, 0.0, 0.0)),  # right without the tool
        (["Sure. <answer> 99246 </answer>"], [], (1.0, 0.0, 0.0)),
        (["<calc>417*238</calc>", "<answer>99245</answer>"], ["result: 99246"], (0.0, 1.0, 1.0)),
        (
            ["Let me compute. <calc>417 * 238</calc>", "<answer>99246</answer>"],
            ["result: 99246"],
            (1.0, 1.0, 1.0),
        ),  # fmt: skip
        (
            ["<calc>2+2</calc>", "<calc>417*238</calc>", "<answer>99246</answer>"],
            ["result: 4", "result: 99246"],
            (1.0, 2.0, 1.0),
        ),  # fmt: skip
        (
            ["<calc>1/0</calc>", "<answer>99246</answer>"],
            ["error: operator Div is not allowed"],
            (1.0, 1.0, 1.0),
        ),  # fmt: skip
        (["I do not know"], [], (0.0, 0.0, 0.0)),  # neither a call nor an answer
        (["<answer>99246"], [], (0.0, 0.0, 0.0)),  # an unclosed answer is no answer
        (["<answer>ninety</answer><calc>1+1</calc>"], [], (0.0, 0.0, 0.0)),  # answer ends it
        (["<answer>99246.0</answer>"], [], (0.0, 0.0, 0.0)),
        (["<answer>99246 99246</answer>"], [], (0.0, 0.0, 0.0)),
        (["<answer>" + "9" * 5000 + "</answer>"], [], (0.0, 0.0, 0.0)),  # int() would raise
        (
            ["<calc>1+1</calc>", "<calc>2+2</calc>", "<calc>417*238</calc>"],
            ["result: 2", "result: 4"],
            (0.0, 2.0, 1.0),  # the third call is over max_tool_calls = 2: ends with 0
        ),
    ],
)
def test_rollouts_score_as_documented(replies, said, scores):
    got_said, got = play(make_env(), SAMPLE, replies)
    assert got_said == said
    assert (got["calculator_score"], got["tool_calls"], got["used_tool"]) == scores


def test_max_tool_calls_is_configurable():
    environment = make_env(max_turns=2, max_tool_calls=1)
    said, scores = play(environment, SAMPLE, ["<calc>1+1</calc>", "<calc>2+2</calc>"])
    assert said == ["result: 2"]
    assert scores == {"calculator_score": 0.0, "tool_calls": 1.0, "used_tool": 1.0}


@pytest.mark.parametrize(
    ("expression", "reply"),
    [
        ("417 * 238", "result: 99246"),
        (" (2+3)*4-10 ", "result: 10"),
        ("3-5", "result: -2"),
        ("__import__('os').system('x')", "error: Call is not allowed"),
        ("open('/etc/passwd').read()", "error: Call is not allowed"),
        ("x", "error: Name is not allowed"),
        ("9**9**9", "error: operator Pow is not allowed"),
        ("1/0", "error: operator Div is not allowed"),
        ("7//2", "error: operator FloorDiv is not allowed"),
        ("-5", "error: UnaryOp is not allowed"),
        ("2.5*2", "error: Constant is not allowed"),
        ("True+1", "error: Constant is not allowed"),
        ("9999999*9999999", "error: value out of range"),
        ("1" * 20, "error: number 11111111111111111111 out of range"),
        ("", "error: empty expression"),
        ("   ", "error: empty expression"),
        ("1+" * 300 + "1", "error: longer than 200 characters"),
        ("(" * 99 + "1" + ")" * 99, "result: 1"),  # as deep as 200 characters allow
        ("1" + "*1" * 99, "result: 1"),
        ("４+1", "error: not an expression (SyntaxError)"),  # full-width digit
        ("1 × 2", "error: not an expression (SyntaxError)"),
        ("1\x00", "error: not an expression (SyntaxError)"),
        ("1+", "error: not an expression (SyntaxError)"),
    ],
)
def test_the_tool_answers_every_input_and_refuses_all_but_integer_arithmetic(expression, reply):
    assert tool_reply(expression) == reply


def test_a_rollout_without_signals_scores_zero():
    rubric = make_env().rubric()
    empty = Rollout(group_id=0, rollout_id=0, session_id="s", sample=SAMPLE)
    assert rubric.score(empty) == (
        0.0,
        {"calculator_score": 0.0, "tool_calls": 0.0, "used_tool": 0.0},
    )
    empty.turns = [turn_with("<calc>1+1</calc>", {CALLED: 1.0}), turn_with("<answer>99", {})]
    assert rubric.score(empty)[0] == 0.0  # truncated: the last step never ran
    empty.turns.append(turn_with("<answer>99246</answer>", {SCORE: 1.0}))
    assert rubric.score(empty) == (
        1.0,
        {"calculator_score": 1.0, "tool_calls": 1.0, "used_tool": 1.0},
    )


def test_max_turns_must_leave_a_turn_to_answer():
    with pytest.raises(ValueError, match=r"env.max_turns=2 .* use env.max_turns >= 3"):
        make_env(max_turns=2)
    make_env(max_turns=2, max_tool_calls=1)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"min_digits": 0}, "env.args.min_digits"),
        ({"min_digits": 4, "max_digits": 3}, "env.args.max_digits"),
        ({"max_digits": 7}, "env.args.max_digits"),
        ({"operations": ""}, "env.args.operations"),
        ({"operations": "*/"}, "env.args.operations"),
        ({"max_tool_calls": 0}, "env.args.max_tool_calls"),
    ],
)
def test_config_validate_names_the_bad_field(args, field):
    with pytest.raises(ValueError, match=field):
        CalculatorConfig(**args).validate()


def test_samples_respect_digits_and_operations():
    environment = make_env(min_digits=1, max_digits=6, operations="+-")
    for index in range(200):
        sample = environment.train_sample(index)
        assert sample["op"] in "+-"
        assert all(0 <= sample[k] < 10**6 for k in ("a", "b"))
        said, scores = play(
            environment, sample, [m["content"] for m in environment.demonstration(sample)[1::2]]
        )
        assert scores["calculator_score"] == 1.0


def test_splits_are_disjoint_and_deterministic():
    def key(sample: dict) -> tuple:
        return sample["a"], sample["op"], sample["b"]

    # 1-digit operands and one operator: 100 contents, so 2000 draws see most of them.
    small = make_env(min_digits=1, max_digits=1, operations="*")
    validation = {key(s) for s in small.validation_samples(64)}
    train = {key(small.train_sample(i)) for i in range(2000)}
    assert len(train) > 50 and validation and not train & validation
    environment = make_env()
    assert environment.validation_samples(16) == make_env().validation_samples(16)
    assert environment.validation_samples(4) == environment.validation_samples(16)[:4]
    assert environment.train_sample(5) == make_env().train_sample(5)
    assert environment.train_sample(5) != make_env(seed=1).train_sample(5)
    assert environment.train_sample(-1) != environment.train_sample(1)


def test_demonstration_matches_rollout_rendering_with_tool_replies_out_of_the_loss():
    renderer = Renderer(Tokenizer.from_file(None))
    environment = make_env()
    sample = environment.train_sample(3)
    demo = environment.demonstration(sample)
    env = environment.make_env(sample)

    async def rollout_ids() -> list[np.ndarray]:
        parts = [renderer.render_prompt(await env.init())]
        for reply in (demo[1], demo[3]):
            completion = renderer.tokenizer.encode(reply["content"])
            parts.append(np.asarray(completion + [renderer.tokenizer.im_end_id], np.int32))
            result = await env.step(renderer.parse_completion(parts[-1]))
            if not result.done:
                parts.append(renderer.render_continuation(result.messages, True))
        return parts

    parts = asyncio.run(rollout_ids())
    ids, mask = renderer.render_demonstration(demo)
    np.testing.assert_array_equal(ids, np.concatenate(parts))
    # P0 + A0 + E0 + A1: the tool's reply E0 ("result: N") is in the tokens, out of the loss.
    expected = [np.zeros(len(p), bool) if i % 2 == 0 else np.ones(len(p), bool)
                for i, p in enumerate(parts)]  # fmt: skip
    np.testing.assert_array_equal(mask, np.concatenate(expected))
    assert "result: " + str(answer_of(sample)) in renderer.tokenizer.decode(parts[2].tolist())


def test_the_config_runs_calculator_and_its_demonstrations_fit():
    config = load_config(CONFIG)
    assert config.env.name == "calculator" and config.env.max_turns == 3
    environment = Calculator(config.env, 0, config.env_args())
    assert config.env.max_turns >= environment.section.max_tool_calls + 1
    renderer = Renderer(Tokenizer.from_file(None))
    samples = [environment.train_sample(i) for i in range(200)]
    samples += environment.validation_samples(config.validation.num_samples)
    for sample in samples:
        demo = environment.demonstration(sample)
        ids, _ = renderer.render_demonstration(demo)
        assert len(ids) <= min(config.batcher.seq_len, config.env.max_rollout_tokens)
        assert len(renderer.render_prompt(demo[:1])) <= 60
        for reply in demo[1::2]:  # each reply plus its <|im_end|> fits one completion
            assert len(renderer.tokenizer.encode(reply["content"])) + 1 <= config.rollout.max_tokens


def test_max_digits_bounds_every_operand():
    environment = make_env(min_digits=1, max_digits=2)
    samples = [environment.train_sample(i) for i in range(100)]
    samples += environment.validation_samples(20)
    operands = [s[k] for s in samples for k in ("a", "b")]
    assert all(0 <= x < 100 for x in operands)
    assert any(x >= 10 for x in operands)  # 2-digit operands are drawn too
    assert any(x < 10 for x in operands)  # and 1-digit ones (min_digits=1)


def test_min_digits_bounds_every_operand_from_below():
    environment = make_env(min_digits=4, max_digits=4)
    samples = [environment.train_sample(i) for i in range(100)]
    assert all(1000 <= s[k] < 10_000 for s in samples for k in ("a", "b"))
