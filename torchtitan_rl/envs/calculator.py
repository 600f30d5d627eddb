"""Calculator: multi-turn tool use on arithmetic a tiny model cannot do in its head.

    user:      What is 417 * 238? Use <calc>expression</calc> to compute; answer inside
               <answer> tags.
    assistant: <calc>417*238</calc>
    user:      result: 99246                   (the tool's reply: in the tokens, out of the loss)
    assistant: <answer>99246</answer>          -> 1.0, done

An assistant turn holding an <answer> ends the rollout: 1 for the right integer, else 0.
Otherwise a <calc> block is evaluated by `envs/arithmetic.py` (an AST walk over integers and
+ - *, never `eval`) and the result (or "error: ...") comes back as the next user message. A
turn with neither, or a call beyond `max_tool_calls`, ends the rollout with 0. The rubric also
records, at weight 0, the tool calls per rollout and whether the tool was used
(`rollout_reward/tool_calls`, `rollout_reward/used_tool` in TensorBoard).
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Any

from torchtitan_rl.envs.arithmetic import Parsed, format_value, parse
from torchtitan_rl.envs.base import EnvConfig, Environment, MessageEnv, Rubric, StepResult
from torchtitan_rl.types import Message, Rollout

SCORE = "calculator_score"
CALLED = "tool_call"
VALIDATION_ONE_IN = 8
CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL | re.IGNORECASE)
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>", re.IGNORECASE)
OPERATORS = {"*": ast.Mult, "+": ast.Add, "-": ast.Sub}
TOOL_OPERATORS = (ast.Add, ast.Sub, ast.Mult)


@dataclass(kw_only=True, slots=True)
class CalculatorConfig:
    """Calculator's settings: the `[env.args]` table."""

    min_digits: int = 3
    """Fewest digits of each operand, in [1, max_digits]."""
    max_digits: int = 3
    """Most digits of each operand, in [min_digits, 6]."""
    operations: str = "*"
    """Operators drawn from, any of "*+-" (each question has one)."""
    max_tool_calls: int = 2
    """Calculator calls allowed per rollout (>= 1); env.max_turns must be > max_tool_calls."""

    def validate(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 6:
            raise ValueError(
                "env.args: need 1 <= min_digits <= max_digits <= 6, got "
                f"{self.min_digits}, {self.max_digits}"
            )
        if not self.operations or set(self.operations) - set(OPERATORS):
            raise ValueError(
                f"env.args.operations must use only '*', '+', '-', got {self.operations!r}"
            )
        if self.max_tool_calls < 1:
            raise ValueError(f"env.args.max_tool_calls must be >= 1, got {self.max_tool_calls}")


def user_prompt(sample: dict[str, Any]) -> str:
    return (
        f"What is {sample['a']} {sample['op']} {sample['b']}? Use <calc>expression</calc> "
        "to compute; answer inside <answer> tags."
    )


def answer_of(sample: dict[str, Any]) -> int:
    a, b = sample["a"], sample["b"]
    return {"*": a * b, "+": a + b, "-": a - b}[sample["op"]]


def tool_reply(expression: str) -> str:
    """What the calculator says about `expression`."""
    parsed = parse(expression, allowed=TOOL_OPERATORS)
    if isinstance(parsed, Parsed):
        return f"result: {format_value(parsed.value)}"
    return f"error: {parsed.reason}"


def final_score(rollout: Rollout) -> float:
    return rollout.turns[-1].reward_signals.get(SCORE, 0.0) if rollout.turns else 0.0


def tool_calls(rollout: Rollout) -> float:
    return float(sum(t.reward_signals.get(CALLED, 0.0) for t in rollout.turns))


def used_tool(rollout: Rollout) -> float:
    return float(tool_calls(rollout) > 0)


class CalculatorEnv(MessageEnv):
    def __init__(self, sample: dict[str, Any], config: CalculatorConfig):
        self.sample = sample
        self.config = config
        self.calls = 0

    async def init(self) -> list[Message]:
        return [{"role": "user", "content": user_prompt(self.sample)}]

    async def step(self, assistant_message: str) -> StepResult:
        answer = ANSWER.findall(assistant_message)
        if answer:
            right = int(answer[-1]) == answer_of(self.sample)
            return StepResult(messages=[], done=True, reward_signals={SCORE: float(right)})
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

    def _sample(self, split: str, index: int) -> dict[str, Any]:
        rng = random.Random(f"calculator/{split}/{self.seed}/{index}")
        while True:  # a sample lands on its split with odds 1/8 or 7/8
            sample = {
                "a": self._operand(rng),
                "op": rng.choice(self.section.operations),
                "b": self._operand(rng),
            }
            if is_validation(sample) == (split == "validation"):
                return sample

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


def is_validation(sample: dict[str, Any]) -> bool:
    content = json.dumps([sample["a"], sample["op"], sample["b"]]).encode()
    digest = hashlib.blake2b(content, digest_size=8).digest()
    return int.from_bytes(digest, "little") % VALIDATION_ONE_IN == 0
