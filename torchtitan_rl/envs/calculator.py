"""Calculator: multi-turn tool use on arithmetic a tiny model cannot do in its head.

A sample `{"a": 417, "op": "*", "b": 238}` played with the demonstration's replies:

    user:      What is 417 * 238? Call <calc>expression</calc>; answer in <answer> tags.
    assistant: <calc>417*238</calc>            -> tool_call 1.0
    user:      result: 99246                   (the tool's reply: in the tokens, out of the loss)
    assistant: <answer>99246</answer>          -> calculator_score 1.0, done

    rubric: calculator_score 1.0 (weight 1), tool_calls 1.0 and used_tool 1.0 (weight 0)

A turn is read in this order:
  1. it holds a complete <answer>...</answer> block: the rollout ends, scoring 1 if the last
     block is exactly one integer (optional sign, at most `MAX_ANSWER_DIGITS` digits, spaces
     around it allowed) equal to the answer, else 0;
  2. it holds a <calc>...</calc> block and fewer than `max_tool_calls` calls were made: the
     last block is evaluated by `envs/arithmetic.py` (an AST walk over non-negative integer
     literals, + - * and parentheses, every value bounded; never `eval`) and the next user
     message is "result: N" or "error: <why>"; a refused expression still counts as a call;
  3. otherwise (no tag, or a call beyond `max_tool_calls`) the rollout ends with 0.
A rollout cut off before an answer (turn or token budget) scores 0. The weight-0 rubric
functions record the tool calls per rollout and whether the tool was used at all
(`rollout_reward/tool_calls`, `rollout_reward/used_tool`), without changing the reward.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass
from typing import Any

from torchtitan_rl.envs.arithmetic import Parsed, format_value, parse
from torchtitan_rl.envs.base import EnvConfig, Environment, MessageEnv, Rubric, StepResult
from torchtitan_rl.envs.split import Split, split_sample
from torchtitan_rl.types import Message, Rollout

SCORE = "calculator_score"
"""Key of the final answer's score in `StepResult.reward_signals` (and the rubric's name)."""
CALLED = "tool_call"
"""Key set to 1.0 in the signals of a turn whose calculator call was answered."""
MAX_DIGITS = 6
"""Most digits of an operand: 6-digit products stay under arithmetic.MAX_ABS = 10**12."""
MAX_ANSWER_DIGITS = 20
"""Longer "integers" in <answer> are wrong, never parsed (int() refuses > 4300 digits)."""
CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL | re.IGNORECASE)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
INTEGER = re.compile(rf"-?[0-9]{{1,{MAX_ANSWER_DIGITS}}}")
OPERATORS = {"*": ast.Mult, "+": ast.Add, "-": ast.Sub}
"""The question operators `operations` may name, and the calculator's AST operators."""


@dataclass(kw_only=True, slots=True)
class CalculatorConfig:
    """Calculator's settings: the `[env.args]` table."""

    min_digits: int = 3
    """Fewest digits of each operand, in [1, max_digits]."""
    max_digits: int = 3
    """Most digits of each operand, in [min_digits, 6]."""
    operations: str = "*"
    """Operators drawn from, any non-empty mix of "*", "+", "-" (each question has one)."""
    max_tool_calls: int = 2
    """Calculator calls allowed per rollout (>= 1); one more ends the rollout with 0.
    env.max_turns must be >= max_tool_calls + 1 (a turn left to answer)."""

    def validate(self) -> None:
        if not 1 <= self.min_digits <= MAX_DIGITS:
            raise ValueError(
                f"env.args.min_digits must be in [1, {MAX_DIGITS}], got {self.min_digits}"
            )
        if not self.min_digits <= self.max_digits <= MAX_DIGITS:
            raise ValueError(
                f"env.args.max_digits must be in [min_digits={self.min_digits}, {MAX_DIGITS}], "
                f"got {self.max_digits}"
            )
        if not self.operations or set(self.operations) - set(OPERATORS):
            raise ValueError(
                f"env.args.operations must use only '*', '+', '-', got {self.operations!r}"
            )
        if self.max_tool_calls < 1:
            raise ValueError(f"env.args.max_tool_calls must be >= 1, got {self.max_tool_calls}")


def user_prompt(sample: dict[str, Any]) -> str:
    return (
        f"What is {sample['a']} {sample['op']} {sample['b']}? Call <calc>expression</calc>; "
        "answer in <answer> tags."
    )


def answer_of(sample: dict[str, Any]) -> int:
    a, b = sample["a"], sample["b"]
    return {"*": a * b, "+": a + b, "-": a - b}[sample["op"]]


def tool_reply(expression: str) -> str:
    """What the calculator says about `expression`: "result: N" or "error: <why>"."""
    parsed = parse(expression, allowed=tuple(OPERATORS.values()))
    if isinstance(parsed, Parsed):
        return f"result: {format_value(parsed.value)}"
    return f"error: {parsed.reason}"


def answer_score(block: str, sample: dict[str, Any]) -> float:
    """1.0 if the <answer> block is exactly the right integer, else 0.0."""
    text = block.strip()
    return float(INTEGER.fullmatch(text) is not None and int(text) == answer_of(sample))


def final_score(rollout: Rollout) -> float:
    """The answer turn's score; a rollout that never answered (or got cut off) scores 0."""
    return rollout.turns[-1].reward_signals.get(SCORE, 0.0) if rollout.turns else 0.0


def tool_calls(rollout: Rollout) -> float:
    return float(sum(t.reward_signals.get(CALLED, 0.0) for t in rollout.turns))


def used_tool(rollout: Rollout) -> float:
    return float(tool_calls(rollout) > 0)


class CalculatorEnv(MessageEnv):
    """Plays one sample: answers calculator calls until an <answer> (or a rule) ends it."""

    def __init__(self, sample: dict[str, Any], config: CalculatorConfig):
        self.sample = sample
        self.config = config
        self.calls = 0

    async def init(self) -> list[Message]:
        return [{"role": "user", "content": user_prompt(self.sample)}]

    async def step(self, assistant_message: str) -> StepResult:
        answers = ANSWER.findall(assistant_message)
        if answers:
            score = answer_score(answers[-1], self.sample)
            return StepResult(messages=[], done=True, reward_signals={SCORE: score})
        calls = CALC.findall(assistant_message)
        if not calls or self.calls >= self.config.max_tool_calls:
            return StepResult(messages=[], done=True, reward_signals={SCORE: 0.0})
        self.calls += 1
        reply = {"role": "user", "content": tool_reply(calls[-1])}
        return StepResult(messages=[reply], done=False, reward_signals={CALLED: 1.0})


class Calculator(Environment):
    """Samples are `{"a": int, "op": "*" | "+" | "-", "b": int}`."""

    config_class = CalculatorConfig

    def __init__(self, config: EnvConfig, seed: int, args: CalculatorConfig | None = None):
        super().__init__(config, seed, args)
        self.section: CalculatorConfig = self.args
        if config.max_turns <= self.section.max_tool_calls:
            raise ValueError(
                f"env.max_turns={config.max_turns} leaves no turn to answer after "
                f"env.args.max_tool_calls={self.section.max_tool_calls} calls; use env.max_turns "
                f">= {self.section.max_tool_calls + 1}"
            )

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.section.min_digits, self.section.max_digits)
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

    def _draw(self, rng: random.Random) -> dict[str, Any]:
        a, op = self._operand(rng), rng.choice(self.section.operations)
        return {"a": a, "op": op, "b": self._operand(rng)}

    def _sample(self, split: Split, index: int) -> dict[str, Any]:
        return split_sample(
            "calculator",
            seed=self.seed,
            split=split,
            index=index,
            draw=self._draw,
            content=lambda s: [s["a"], s["op"], s["b"]],
        )

    def train_sample(self, index: int) -> dict[str, Any]:
        return self._sample("train", index)

    def validation_samples(self, n: int) -> list[dict[str, Any]]:
        return [self._sample("validation", i) for i in range(n)]

    def make_env(self, sample: dict[str, Any]) -> CalculatorEnv:
        return CalculatorEnv(sample, self.section)

    def rubric(self) -> Rubric:
        return Rubric(
            [
                (SCORE, final_score, 1.0),
                ("tool_calls", tool_calls, 0.0),
                ("used_tool", used_tool, 0.0),
            ]
        )

    def demonstration(self, sample: dict[str, Any]) -> list[Message]:
        expression = f"{sample['a']}{sample['op']}{sample['b']}"
        return [
            {"role": "user", "content": user_prompt(sample)},
            {"role": "assistant", "content": f"<calc>{expression}</calc>"},
            {"role": "user", "content": tool_reply(expression)},
            {"role": "assistant", "content": f"<answer>{answer_of(sample)}</answer>"},
        ]
