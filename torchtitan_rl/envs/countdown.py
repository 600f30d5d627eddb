"""Countdown: reach a target with a few numbers and + - * / (TinyZero's RL benchmark).

    user:      Use 3, 7, 12 to make 33. Each number at most once; + - * / and ( ).
               Answer inside <answer> tags.
    assistant: <answer>3*7+12</answer>        -> 1.0
    assistant: <answer>3+7+12</answer>        -> partial_score (well formed, allowed
                                                 numbers, value 22 != 33)
    assistant: <answer>33</answer>            -> 0 (33 is not one of the numbers)

Puzzles are drawn offline from (seed, index): numbers in [1, max_number], then a target
among the whole numbers in [1, max_target] that some expression over them reaches and that
is not itself one of them. `expressions` finds every reachable value (exact fractions,
every split of every sub-multiset) with its shortest expression, the demonstration, so
every puzzle has a known solution. Answers are parsed by `envs/arithmetic.py` (an AST walk,
never `eval`; unary minus is refused, as the numbers are positive); anything else scores 0
without raising.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from torchtitan_rl.envs.arithmetic import Parsed, parse
from torchtitan_rl.envs.base import EnvConfig, Environment, MessageEnv, Rubric, StepResult
from torchtitan_rl.envs.split import Split, split_sample
from torchtitan_rl.types import Message, Rollout

SCORE = "countdown_score"
SOLVED = "countdown_solved"
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


@dataclass(kw_only=True, slots=True)
class CountdownConfig:
    """Countdown's settings: the `[env.args]` table."""

    min_numbers: int = 3
    """Fewest numbers per puzzle, in [2, max_numbers]."""
    max_numbers: int = 3
    """Most numbers per puzzle, in [min_numbers, 4]."""
    max_number: int = 12
    """Numbers are drawn from [1, max_number], >= 2."""
    max_target: int = 60
    """Targets are whole numbers in [1, max_target]."""
    partial_score: float = 0.1
    """Score of a well-formed answer (only given numbers, each at most once) with the wrong
    value, in [0, 1)."""
    partial_by_distance: bool = False
    """Scale the partial score by how close the wrong value is: partial_score * max(0,
    1 - |value - target| / max(target, 1)), so near misses score more than far ones (a denser
    signal); false gives every well-formed wrong answer partial_score."""
    show_work: bool = False
    """Demonstrations write each operation before the answer ("3*7=21 21+12=33
    <answer>3*7+12</answer>"), so the warm start teaches the arithmetic step by step; the
    reward still reads only the answer. Needs ~2x rollout.max_tokens."""

    def validate(self) -> None:
        if not 2 <= self.min_numbers <= self.max_numbers <= 4:
            raise ValueError(
                "env.args: need 2 <= min_numbers <= max_numbers <= 4, got "
                f"{self.min_numbers}, {self.max_numbers}"
            )
        if self.max_number < 2 or self.max_target < 1:
            raise ValueError(
                f"env.args: max_number must be >= 2 and max_target >= 1, got "
                f"{self.max_number}, {self.max_target}"
            )
        if not 0 <= self.partial_score < 1:
            raise ValueError(f"env.args.partial_score must be in [0, 1), got {self.partial_score}")


SUM, PRODUCT, ATOM = 1, 2, 3
"""Precedence of an expression's top-level operator, which decides its parentheses."""


def expressions(numbers: list[int]) -> dict[Fraction, str]:
    """Every value reachable with a sub-multiset of `numbers` (each used at most once),
    mapped to its shortest expression (ties: the alphabetically first).

    Dynamic programming over subsets: the values of a subset are every operator applied to
    the values of one of its splits into two parts, so 4 numbers cost milliseconds.
    """
    best: dict[int, dict[Fraction, tuple[str, int]]] = {}
    for mask in range(1, 1 << len(numbers)):
        if mask & (mask - 1) == 0:
            n = numbers[mask.bit_length() - 1]
            best[mask] = {Fraction(n): (str(n), ATOM)}
            continue
        found: dict[Fraction, tuple[str, int]] = {}
        left = (mask - 1) & mask
        while left:  # every ordered split (left, mask - left) into non-empty parts
            for a, ea in best[left].items():
                for b, eb in best[mask ^ left].items():
                    for value, text, prec in _combine(a, ea, b, eb):
                        old = found.get(value)
                        if old is None or (len(text), text) < (len(old[0]), old[0]):
                            found[value] = (text, prec)
            left = (left - 1) & mask
        best[mask] = found
    out: dict[Fraction, str] = {}
    for found in best.values():
        for value, (text, _) in found.items():
            if value not in out or (len(text), text) < (len(out[value]), out[value]):
                out[value] = text
    return out


def _combine(a: Fraction, ea: tuple[str, int], b: Fraction, eb: tuple[str, int]):
    """(value, text, precedence) of a+b, a-b, a*b and a/b, with only the parentheses the
    value needs: a-(x+y), (x+y)*b, a/(x*y); a+(x-y) is written a+x-y (same value)."""
    (ta, pa), (tb, pb) = ea, eb
    wrap_a = f"({ta})" if pa == SUM else ta
    yield a + b, f"{ta}+{tb}", SUM
    yield a - b, f"{ta}-({tb})" if pb == SUM else f"{ta}-{tb}", SUM
    yield a * b, f"{wrap_a}*({tb})" if pb == SUM else f"{wrap_a}*{tb}", PRODUCT
    if b != 0:
        yield a / b, f"{wrap_a}/({tb})" if pb != ATOM else f"{wrap_a}/{tb}", PRODUCT


def solve(numbers: list[int], target: int) -> str | None:
    """The shortest expression for `target`, or None when there is none."""
    return expressions(numbers).get(Fraction(target))


def user_prompt(sample: dict[str, Any]) -> str:
    numbers = ", ".join(str(n) for n in sample["numbers"])
    return (
        f"Use {numbers} to make {sample['target']}. Each number at most once; + - * / and "
        "( ). Answer inside <answer> tags."
    )


def score_reply(
    reply: str, sample: dict[str, Any], partial: float, by_distance: bool = False
) -> float:
    """1 for a correct expression, `partial` for a well-formed wrong one (scaled by
    1 - |value - target| / max(|target|, 1), at least 0, when `by_distance`), else 0."""
    found = ANSWER.findall(reply)
    if not found:
        return 0.0
    parsed = parse(found[-1])
    if not isinstance(parsed, Parsed):
        return 0.0
    if Counter(parsed.numbers) - Counter(sample["numbers"]):
        return 0.0  # a number not given, or given fewer times
    if parsed.value == sample["target"]:
        return 1.0
    if not by_distance:
        return partial
    scale = max(abs(sample["target"]), 1)  # a hand-made target of 0 must not divide by 0
    return partial * float(max(0, 1 - abs(parsed.value - sample["target"]) / scale))


def last_score(rollout: Rollout) -> float:
    """The score of the one turn; 0 if it never ran (a truncated rollout)."""
    return rollout.turns[-1].reward_signals.get(SCORE, 0.0) if rollout.turns else 0.0


def solved(rollout: Rollout) -> float:
    """1 for a correct answer: the solve rate, apart from partial scores (a weight-0 metric)."""
    return float(last_score(rollout) == 1.0)


class CountdownEnv(MessageEnv):
    def __init__(self, sample: dict[str, Any], config: CountdownConfig):
        self.sample = sample
        self.config = config

    async def init(self) -> list[Message]:
        return [{"role": "user", "content": user_prompt(self.sample)}]

    async def step(self, assistant_message: str) -> StepResult:
        config = self.config
        score = score_reply(
            assistant_message, self.sample, config.partial_score, config.partial_by_distance
        )
        return StepResult(messages=[], done=True, reward_signals={SCORE: score})


class Countdown(Environment):
    """Samples are `{"numbers": [int, ...], "target": int, "solution": str}`."""

    config_class = CountdownConfig

    def __init__(self, config: EnvConfig, seed: int, args: CountdownConfig | None = None):
        super().__init__(config, seed, args)
        self.section: CountdownConfig = self.args

    def _draw(self, rng: random.Random) -> dict[str, Any] | None:
        s = self.section
        numbers = [
            rng.randint(1, s.max_number) for _ in range(rng.randint(s.min_numbers, s.max_numbers))
        ]
        found = expressions(numbers)
        reachable = [
            v for v in found if v.denominator == 1 and 1 <= v <= s.max_target and v not in numbers
        ]
        if not reachable:
            return None
        target = rng.choice(sorted(reachable))
        return {"numbers": numbers, "target": int(target), "solution": found[target]}

    def _sample(self, split: Split, index: int) -> dict[str, Any]:
        return split_sample(
            "countdown",
            seed=self.seed,
            split=split,
            index=index,
            draw=self._draw,
            content=lambda s: [sorted(s["numbers"]), s["target"]],
        )

    def train_sample(self, index: int) -> dict[str, Any]:
        return self._sample("train", index)

    def validation_samples(self, n: int) -> list[dict[str, Any]]:
        return [self._sample("validation", i) for i in range(n)]

    def make_env(self, sample: dict[str, Any]) -> CountdownEnv:
        return CountdownEnv(sample, self.section)

    def rubric(self) -> Rubric:
        return Rubric([(SCORE, last_score, 1.0), (SOLVED, solved, 0.0)])

    def demonstration(self, sample: dict[str, Any]) -> list[Message]:
        return [
            {"role": "user", "content": user_prompt(sample)},
            {"role": "assistant", "content": demonstration_reply(sample, self.section.show_work)},
        ]


def demonstration_reply(sample: dict[str, Any], show_work: bool) -> str:
    answer = f"<answer>{sample['solution']}</answer>"
    if not show_work:
        return answer
    parsed = parse(sample["solution"])
    assert isinstance(parsed, Parsed), sample
    return " ".join([*parsed.steps, answer])
