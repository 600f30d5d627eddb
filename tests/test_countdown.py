"""Countdown: every puzzle is solvable, the reward is exact and never raises."""

import asyncio
import re
from collections import Counter
from fractions import Fraction
from operator import add, mul, sub, truediv

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_rl.config import load_config
from torchtitan_rl.envs.arithmetic import Invalid, Parsed, parse
from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.envs.countdown import (
    Countdown,
    CountdownConfig,
    expressions,
    last_score,
    score_reply,
    solve,
)
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.models.tokenizer import Tokenizer
from torchtitan_rl.types import Completion, FinishReason, Rollout, RolloutTurn

SAMPLE = {"numbers": [3, 7, 12], "target": 33, "solution": "3*7+12"}


def turn_with(signals: dict[str, float]) -> RolloutTurn:
    completion = Completion(
        request_id="r",
        token_ids_N=np.zeros(1, dtype=np.int32),
        logprobs_N=np.zeros(1, dtype=np.float32),
        finish_reason=FinishReason.LENGTH,
    )
    return RolloutTurn(
        prompt_ids=np.zeros(1, dtype=np.int32),
        completion=completion,
        assistant_text="",
        reward_signals=signals,
    )


def _env(seed=0, **args):
    return Countdown(EnvConfig(max_turns=1), seed, CountdownConfig(**args))


@pytest.mark.parametrize("args", [{}, {"min_numbers": 4, "max_numbers": 4}])
def test_every_puzzle_has_a_solution_that_scores_one(args):
    env = _env(**args)
    samples = [env.train_sample(i) for i in range(-20, 60)] + env.validation_samples(40)
    for s in samples:
        parsed = parse(s["solution"])
        assert isinstance(parsed, Parsed) and parsed.value == s["target"], s
        assert 1 <= s["target"] <= env.section.max_target and s["target"] not in s["numbers"]
        reply = env.demonstration(s)[-1]["content"]
        assert score_reply(reply, s, 0.1) == 1.0


def test_splits_are_disjoint_and_deterministic():
    env = _env()
    key = lambda s: (tuple(sorted(s["numbers"])), s["target"])  # noqa: E731
    train = {key(env.train_sample(i)) for i in range(300)}
    validation = {key(s) for s in env.validation_samples(64)}
    assert not train & validation
    assert env.validation_samples(5) == _env().validation_samples(5)
    assert env.train_sample(3) == _env().train_sample(3) != _env(seed=1).train_sample(3)


@pytest.mark.parametrize(
    "reply, score",
    [
        ("<answer>3*7+12</answer>", 1.0),
        ("<answer>(12 + 3 * 7)</answer>", 1.0),
        ("thinking... <answer>3+7+12</answer>", 0.1),  # well formed, wrong value
        ("<answer>7*7-12-3</answer>", 0.0),  # 7 used twice
        ("<answer>33</answer>", 0.0),  # not a given number
        ("<answer>3*7+12", 0.0),  # no closing tag
        ("3*7+12", 0.0),
        ("<answer>__import__('os').system('ls')</answer>", 0.0),
        ("<answer>2**1000</answer>", 0.0),
        ("<answer>12/(7-7)</answer>", 0.0),
        ("<answer>-3+36</answer>", 0.0),  # unary minus is not allowed
        ("<answer>3.0*7+12</answer>", 0.0),
        ("<answer>" + "(" * 500 + "3" + ")" * 500 + "</answer>", 0.0),
        ("<answer>３*7+12</answer>", 0.0),  # a full-width digit
        ("<answer>" + "3+" * 5000 + "7</answer>", 0.0),  # past the length cap
        ("<answer>12+7*3+9999999999999</answer>", 0.0),  # huge literal
        ("<answer>True+32</answer>", 0.0),
        ("<answer></answer>", 0.0),
        ("", 0.0),
    ],
)
def test_reply_scores(reply, score):
    assert score_reply(reply, SAMPLE, 0.1) == score


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_text_scores_without_raising(text):
    assert score_reply(f"<answer>{text}</answer>", SAMPLE, 0.1) in (0.0, 0.1, 1.0)
    assert isinstance(parse(text), Parsed | Invalid)


def test_solver_writes_the_shortest_expression_with_only_needed_parentheses():
    assert solve([3, 7, 12], 33) == "12+3*7"
    assert solve([9, 12, 4], 27) == "12*9/4"
    assert solve([2, 3, 4], 20) == "(2+3)*4"
    assert solve([30, 2, 4], 5) == "30/(2+4)"
    assert solve([3, 7, 12], 3) == "3"  # a sub-multiset suffices
    assert solve([3, 3, 8, 8], 24) == "3*8"
    assert solve([1, 5, 5, 5], 124) == "5*5*5-1"
    assert solve([1, 1], 50) is None


def reference_values(items: list[Fraction]) -> set[Fraction]:
    """Every value of every expression tree over a sub-multiset, by repeatedly replacing
    two items with one combination of them (independent of the solver's subset split)."""
    values = set(items)
    for i, a in enumerate(items):
        for j, b in enumerate(items):
            if i != j:
                rest = [x for k, x in enumerate(items) if k not in (i, j)]
                for v in [a + b, a - b, a * b] + ([a / b] if b else []):
                    values |= reference_values([*rest, v])
    return values


@pytest.mark.parametrize("numbers", [[3, 3, 8, 8], [1, 5, 5, 5], [2, 7, 11], [4, 9]])
def test_solver_reaches_every_value_and_each_expression_is_right(numbers):
    found = expressions(numbers)
    assert set(found) == reference_values([Fraction(n) for n in numbers])
    for value, text in found.items():
        parsed = parse(text)
        assert isinstance(parsed, Parsed) and parsed.value == value, text
        assert not Counter(parsed.numbers) - Counter(numbers), text


def test_env_plays_one_turn_and_the_rubric_reads_its_score():
    env = _env()
    sample = env.train_sample(0)
    played = env.make_env(sample)
    messages = asyncio.run(played.init())
    result = asyncio.run(played.step(env.demonstration(sample)[-1]["content"]))
    assert result.done and not result.messages and result.reward_signals["countdown_score"] == 1
    assert str(sample["target"]) in messages[0]["content"]
    empty = Rollout(group_id=0, rollout_id=0, session_id="s", sample=sample)
    assert last_score(empty) == 0.0  # truncated before any turn: 0, no error
    empty.turns = [turn_with({})]  # truncated: the turn was never scored
    assert env.rubric().score(empty) == (0.0, {"countdown_score": 0.0, "countdown_solved": 0.0})
    empty.turns = [turn_with({"countdown_score": 0.1})]  # well formed, wrong: not solved
    assert env.rubric().score(empty) == (0.1, {"countdown_score": 0.1, "countdown_solved": 0.0})
    empty.turns = [turn_with({"countdown_score": 1.0})]
    assert env.rubric().score(empty) == (1.0, {"countdown_score": 1.0, "countdown_solved": 1.0})


def test_show_work_demonstrations_write_each_operation_before_the_answer():
    sample = {"numbers": [3, 7, 12], "target": 33, "solution": "3*7+12"}
    assert (
        _env(show_work=True).demonstration(sample)[-1]["content"]
        == "3*7=21 21+12=33 <answer>3*7+12</answer>"
    )
    assert _env().demonstration(sample)[-1]["content"] == "<answer>3*7+12</answer>"
    for numbers in (3, 4):
        env = _env(show_work=True, min_numbers=numbers, max_numbers=numbers)
        for s in _samples(env, n=150):
            reply = env.demonstration(s)[-1]["content"]
            *steps, answer = reply.split(" ")
            assert score_reply(reply, s, 0.1) == 1.0 and steps[-1].endswith(f"={s['target']}")
            for step in steps:  # each step is true arithmetic, read as written
                a, op, b, c = STEP.fullmatch(step).groups()
                value = {"+": add, "-": sub, "*": mul, "/": truediv}[op](_number(a), _number(b))
                assert value == _number(c), step


STEP = re.compile(r"(\(-?[\d/]+\)|\d+)([-+*/])(\(-?[\d/]+\)|\d+)=(-?[\d/]+)")
"""One shown step: operands are plain whole numbers or bracketed fractions/negatives."""


def _number(text: str) -> Fraction:
    return Fraction(text.strip("()"))


def test_steps_bracket_fractions_and_negatives_so_they_read_right():
    assert parse("(3 + 5) * 2").steps == ["3+5=8", "8*2=16"]
    assert parse("1/(1/3)").steps == ["1/3=1/3", "1/(1/3)=3"]
    assert parse("(1-11)*(6-9)").steps == ["1-11=-10", "6-9=-3", "(-10)*(-3)=30"]
    assert parse("7").steps == []


def test_the_config_runs_countdown_and_its_demonstrations_fit():
    config = load_config("train_configs/countdown_tiny.toml")
    assert config.env.name == "countdown"
    env = Countdown(config.env, 0, config.env_args())
    renderer = Renderer(Tokenizer.from_file(None))
    longest = max(
        len(renderer.render_prompt(env.demonstration(env.train_sample(i)))) for i in range(200)
    )
    assert longest <= config.batcher.seq_len


def _samples(env, n=50):
    return [env.train_sample(i) for i in range(n)] + env.validation_samples(10)


@pytest.mark.parametrize("count", [2, 3, 4])
def test_min_and_max_numbers_fix_how_many_numbers_each_puzzle_has(count):
    samples = _samples(_env(min_numbers=count, max_numbers=count))
    assert {len(s["numbers"]) for s in samples} == {count}


def test_numbers_range_from_min_numbers_to_max_numbers():
    samples = _samples(_env(min_numbers=2, max_numbers=4), n=100)
    assert {len(s["numbers"]) for s in samples} == {2, 3, 4}


def test_max_number_bounds_every_number():
    samples = _samples(_env(max_number=5))
    numbers = [n for s in samples for n in s["numbers"]]
    assert all(1 <= n <= 5 for n in numbers) and max(numbers) == 5
    # the default (12) would draw larger numbers across as many samples
    assert max(n for s in _samples(_env()) for n in s["numbers"]) > 5


def test_max_target_bounds_every_target():
    samples = _samples(_env(max_target=10))
    assert all(1 <= s["target"] <= 10 for s in samples)
    # the default (60) would give larger targets across as many samples
    assert max(s["target"] for s in _samples(_env())) > 10


def test_partial_score_is_what_a_well_formed_wrong_answer_scores():
    for partial in (0.0, 0.25, 0.5):
        env = _env(partial_score=partial)
        sample = env.train_sample(0)
        wrong = "+".join(str(n) for n in sample["numbers"])
        if parse(wrong).value == sample["target"]:
            wrong = "*".join(str(n) for n in sample["numbers"])
        assert parse(wrong).value != sample["target"]
        result = asyncio.run(env.make_env(sample).step(f"<answer>{wrong}</answer>"))
        assert result.reward_signals["countdown_score"] == partial
        right = env.demonstration(sample)[-1]["content"]
        assert (
            asyncio.run(env.make_env(sample).step(right)).reward_signals["countdown_score"] == 1.0
        )


@pytest.mark.parametrize(
    "answer, by_distance",
    [
        ("3*7+12", 1.0),  # right: 1 either way
        ("3+7+12", 0.1 * (1 - 11 / 33)),  # 22 is 11 away from 33
        ("3*12", 0.1 * (1 - 3 / 33)),  # 36: a near miss scores more
        ("3*7*12", 0.0),  # 252: more than the target away, floored at 0
        ("7*7", 0.0),  # 7 twice: malformed, 0 either way
    ],
)
def test_partial_by_distance_scales_the_partial_score_by_closeness(answer, by_distance):
    reply = f"<answer>{answer}</answer>"
    assert score_reply(reply, SAMPLE, 0.1, by_distance=True) == pytest.approx(by_distance)
    flat = score_reply(reply, SAMPLE, 0.1)
    assert flat == (1.0 if by_distance == 1.0 else 0.0 if answer == "7*7" else 0.1)
    env = _env(partial_by_distance=True)
    signals = asyncio.run(env.make_env(SAMPLE).step(reply)).reward_signals
    assert signals["countdown_score"] == pytest.approx(by_distance)


def test_partial_by_distance_takes_a_target_of_zero():
    sample = {"numbers": [3, 7], "target": 0}  # a hand-made sample: no division by zero
    assert score_reply("<answer>7-3</answer>", sample, 0.1, by_distance=True) == 0.0
    assert score_reply("<answer>3/7</answer>", sample, 0.1, by_distance=True) == pytest.approx(
        0.1 * (1 - 3 / 7)
    )
