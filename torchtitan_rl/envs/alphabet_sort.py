"""AlphabetSort: sort names by first or last name, with new names arriving every turn.

A 2-turn episode sorted by last name (`sample = {"sort_by": "last", "names_per_turn":
[["Mary Young", "Paul Adams"], ["Laura Hill"]]}`):

    user:      Sort these names by last name. Reply inside <alphabetical_sorted> tags,
               one name per line.
               Mary Young
               Paul Adams
    assistant: <alphabetical_sorted>
               Paul Adams
               Mary Young
               </alphabetical_sorted>
               -> turn_score 1.0
    user:      New names:
               Laura Hill
               Sort ALL names so far by last name. Reply inside <combined_alphabetical_sorted>
               tags, one name per line, each new name followed by " // new name!".
    assistant: <combined_alphabetical_sorted>
               Paul Adams
               Laura Hill // new name!
               Mary Young
               </combined_alphabetical_sorted>
               -> turn_score 1.0, done; rollout reward = mean turn score = 1.0

A turn's score is `SequenceMatcher(None, got, expected).ratio() ** reward_power` over the
normalised block inside the expected tag (0 when the tag is missing). Ties on the key are
broken by the full name.
"""

from __future__ import annotations

import difflib
import random
import re
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any

from torchtitan_rl.checks import check_range
from torchtitan_rl.envs.base import EnvConfig, Environment, MessageEnv, Rubric, StepResult
from torchtitan_rl.envs.split import Split, split_sample
from torchtitan_rl.types import Message, Rollout

NAMES_PATH = Path(__file__).parent / "data" / "names.txt"
MAX_NAMES_PER_TURN = 5
SORTED_TAG = "alphabetical_sorted"
COMBINED_TAG = "combined_alphabetical_sorted"
NEW_MARK = " // new name!"
TURN_SCORE = "turn_score"
"""Key of the per-turn score in `StepResult.reward_signals`."""


class SortBy(StrEnum):
    FIRST = "first"
    LAST = "last"
    RANDOM = "random"  # per sample, first or last with equal odds


@dataclass(kw_only=True, slots=True)
class AlphabetSortConfig:
    """AlphabetSort's settings: the `[env.args]` table."""

    min_names: int = 1
    """Fewest new names shown per turn, in [1, max_names]."""
    max_names: int = 5
    """Most new names shown per turn, in [min_names, 5]."""
    reward_power: float = 4.0
    """Exponent applied to each turn's similarity ratio, finite and > 0; larger rewards
    near-perfect more."""
    sort_by: str = "random"
    """Sort key: "first", "last", or "random" (first or last drawn per sample)."""

    def validate(self) -> None:
        if not 1 <= self.min_names <= MAX_NAMES_PER_TURN:
            raise ValueError(
                f"env.args.min_names must be in [1, {MAX_NAMES_PER_TURN}], got {self.min_names}"
            )
        if not self.min_names <= self.max_names <= MAX_NAMES_PER_TURN:
            raise ValueError(
                f"env.args.max_names must be in [min_names={self.min_names}, "
                f"{MAX_NAMES_PER_TURN}], got {self.max_names}"
            )
        check_range("env.args.reward_power", self.reward_power, gt=0)
        if self.sort_by not in tuple(SortBy):
            raise ValueError(
                f"env.args.sort_by must be one of {[s.value for s in SortBy]}, got {self.sort_by!r}"
            )


@cache
def load_names(path: Path = NAMES_PATH) -> tuple[str, ...]:
    """The offline name pool, "First Last" per line, in file order."""
    names = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    assert len(set(names)) == len(names), f"duplicate names in {path}"
    return names


def sort_names(names: list[str], sort_by: str) -> list[str]:
    """Sort by first or last name, ties broken by the full name."""
    key_index = 0 if sort_by == SortBy.FIRST else -1
    return sorted(names, key=lambda n: (n.split()[key_index].casefold(), n.casefold()))


def expected_lines(sample: dict[str, Any], turn: int) -> list[str]:
    """Gold answer lines of `turn` (0-based): all names so far, sorted, new ones marked."""
    names_per_turn = sample["names_per_turn"]
    seen = [name for names in names_per_turn[: turn + 1] for name in names]
    new = set(names_per_turn[turn]) if turn > 0 else set()
    return [n + NEW_MARK if n in new else n for n in sort_names(seen, sample["sort_by"])]


def answer_tag(turn: int) -> str:
    return SORTED_TAG if turn == 0 else COMBINED_TAG


def user_prompt(sample: dict[str, Any], turn: int) -> str:
    names = "\n".join(sample["names_per_turn"][turn])
    key = sample["sort_by"]
    if turn == 0:
        return (
            f"Sort these names by {key} name. Reply inside <{SORTED_TAG}> tags, "
            f"one name per line.\n{names}"
        )
    return (
        f"New names:\n{names}\nSort ALL names so far by {key} name. Reply inside "
        f'<{COMBINED_TAG}> tags, one name per line, each new name followed by "{NEW_MARK}".'
    )


def gold_reply(sample: dict[str, Any], turn: int) -> str:
    tag = answer_tag(turn)
    return f"<{tag}>\n" + "\n".join(expected_lines(sample, turn)) + f"\n</{tag}>"


def extract_block(text: str, tag: str) -> str | None:
    """Content of the last complete <tag>...</tag> block, or None if there is none; the
    tags match in any case, as in the original environment."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL | re.IGNORECASE)
    return blocks[-1] if blocks else None


def normalise(lines: list[str]) -> str:
    """Lines with whitespace collapsed and case folded, empty lines dropped, joined by \\n."""
    cleaned = (" ".join(line.split()).casefold() for line in lines)
    return "\n".join(line for line in cleaned if line)


def score_turn(reply: str, sample: dict[str, Any], turn: int, reward_power: float) -> float:
    block = extract_block(reply, answer_tag(turn))
    if block is None:
        return 0.0
    got = normalise(block.splitlines())
    expected = normalise(expected_lines(sample, turn))
    return difflib.SequenceMatcher(None, got, expected).ratio() ** reward_power


def mean_turn_score(rollout: Rollout) -> float:
    """Mean turn score over the sample's turns; a turn never played or never scored counts 0."""
    num_turns = len(rollout.sample["names_per_turn"])
    played = rollout.turns[:num_turns]
    return sum(t.reward_signals.get(TURN_SCORE, 0.0) for t in played) / num_turns


class AlphabetSortEnv(MessageEnv):
    """Plays one sample: one user message per turn, scoring each reply as it comes."""

    def __init__(self, sample: dict[str, Any], config: AlphabetSortConfig):
        self.sample = sample
        self.config = config
        self.turn = 0

    async def init(self) -> list[Message]:
        return [{"role": "user", "content": user_prompt(self.sample, 0)}]

    async def step(self, assistant_message: str) -> StepResult:
        num_turns = len(self.sample["names_per_turn"])
        if self.turn >= num_turns:
            raise RuntimeError(f"step called after the episode ended ({num_turns} turns)")
        score = score_turn(assistant_message, self.sample, self.turn, self.config.reward_power)
        self.turn += 1
        done = self.turn == num_turns
        messages = (
            [] if done else [{"role": "user", "content": user_prompt(self.sample, self.turn)}]
        )
        return StepResult(messages=messages, done=done, reward_signals={TURN_SCORE: score})


class AlphabetSort(Environment):
    """Samples are `{"sort_by": "first" | "last", "names_per_turn": [[name, ...], ...]}`
    with `env.max_turns` turns of distinct names."""

    config_class = AlphabetSortConfig

    def __init__(self, config: EnvConfig, seed: int, args: AlphabetSortConfig | None = None):
        super().__init__(config, seed, args)
        self.section: AlphabetSortConfig = self.args
        self.names = load_names()
        needed = config.max_turns * self.section.max_names
        if needed > len(self.names):
            raise ValueError(
                f"env.max_turns={config.max_turns} with env.args.max_names="
                f"{self.section.max_names} needs {needed} distinct names; the pool has "
                f"{len(self.names)}, so keep max_turns * max_names <= {len(self.names)}"
            )

    def _draw(self, rng: random.Random) -> dict[str, Any]:
        counts = [
            rng.randint(self.section.min_names, self.section.max_names)
            for _ in range(self.config.max_turns)
        ]
        chosen = rng.sample(self.names, sum(counts))
        sort_by = self.section.sort_by
        if sort_by == SortBy.RANDOM:
            sort_by = rng.choice((SortBy.FIRST, SortBy.LAST))
        names_per_turn, start = [], 0
        for count in counts:
            names_per_turn.append(chosen[start : start + count])
            start += count
        return {"sort_by": str(sort_by), "names_per_turn": names_per_turn}

    def _sample(self, split: Split, index: int) -> dict[str, Any]:
        return split_sample(
            "alphabet_sort",
            seed=self.seed,
            split=split,
            index=index,
            draw=self._draw,
            content=lambda s: [s["sort_by"], s["names_per_turn"]],
        )

    def train_sample(self, index: int) -> dict[str, Any]:
        return self._sample("train", index)

    def validation_samples(self, n: int) -> list[dict[str, Any]]:
        return [self._sample("validation", i) for i in range(n)]

    def make_env(self, sample: dict[str, Any]) -> AlphabetSortEnv:
        return AlphabetSortEnv(sample, self.section)

    def rubric(self) -> Rubric:
        return Rubric([("sort_score", mean_turn_score, 1.0)])

    def demonstration(self, sample: dict[str, Any]) -> list[Message]:
        messages: list[Message] = []
        for turn in range(len(sample["names_per_turn"])):
            messages.append({"role": "user", "content": user_prompt(sample, turn)})
            messages.append({"role": "assistant", "content": gold_reply(sample, turn)})
        return messages
