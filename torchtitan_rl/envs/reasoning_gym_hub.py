"""reasoning-gym datasets, unmodified: `[env] name = "reasoning_gym:<dataset>"`.

Any dataset of `reasoning_gym.factory.DATASETS` runs as it is: `[env.args]` is the dataset's
own config dataclass (checked key by key; its `validate()` runs, its asserts reported as one
line), plus one key of ours, `system_prompt`. A rollout is one turn:

    system:    <reasoning_gym.utils.SYSTEM_PROMPTS[system_prompt]>   (none when "")
    user:      Spell this word backward (example: sun -> nus): bird   (the dataset's question)
    assistant: <answer>drib</answer>
               -> score_answer(extract_answer(reply), entry) = 1.0 (the dataset's own scorer;
                  one that raises on a malformed reply scores 0: `WrongAnswer`)

The dataset is one instance: its `seed` (the job seed when unset) and `size`, the pool of
item indices [0, size) samples are drawn from. Which split an item is on is decided by a hash
of its question (`envs/split.py`), so train and validation never share a question. Samples
are `{"index": i, "question": str, "answer": str | None}`; the scorer gets the dataset's full
entry `dataset[i]` back. Demonstrations answer with the gold answer, where there is one.
reasoning_gym is imported only when such a name is resolved (`pip install
'torchtitan_rl[hubs]'`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import random
from functools import cache, lru_cache
from typing import Any, ClassVar

from torchtitan_rl.envs.base import (
    EnvConfig,
    Environment,
    MessageEnv,
    Rubric,
    StepResult,
    WrongAnswer,
)
from torchtitan_rl.envs.split import Split, split_sample
from torchtitan_rl.types import Message, Rollout

HUB = "reasoning_gym"
SCORE = "score_answer"
"""The rubric's one function: the dataset's `score_answer` on the extracted answer."""
ENTRY_CACHE = 4096
"""Dataset entries kept per environment, so scoring a group regenerates its entry once."""


@cache
def reasoning_gym_environment(dataset: str) -> type[Environment]:
    """The Environment class of one reasoning-gym dataset (one class per name, so its
    `config_class` is the same object every time it is resolved)."""
    name = f"{HUB}:{dataset}"
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ValueError(
            f"env.name={name!r} needs reasoning-gym, which is not installed: "
            "pip install 'torchtitan_rl[hubs]' (or reasoning-gym==0.1.25)"
        )
    from reasoning_gym.factory import DATASETS

    if dataset not in DATASETS:
        close = difflib.get_close_matches(dataset, list(DATASETS), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"env.name={name!r}: reasoning-gym has no dataset {dataset!r} ({len(DATASETS)} "
            f"datasets, listed by reasoning_gym.factory.DATASETS){hint}"
        )
    dataset_cls, base_config = DATASETS[dataset]
    config_class = _config_class(base_config)
    attrs = {
        "config_class": config_class,
        "dataset_name": dataset,
        "dataset_class": dataset_cls,
        "dataset_config": base_config,
    }
    return type(f"ReasoningGym[{dataset}]", (ReasoningGym,), attrs)


def _config_class(base: type) -> type:
    """The dataset's config dataclass plus `system_prompt`, whose `validate()` reports the
    dataset's asserts as ValueError (the config loader's one-line errors)."""

    @dataclasses.dataclass
    class HubConfig(base):
        system_prompt: str = "direct"
        """A key of reasoning_gym.utils.SYSTEM_PROMPTS ("direct", "default", "simple", ...)
        sent as the system message, or "" for none. Answers are read from <answer> tags."""

        def validate(self) -> None:
            from reasoning_gym.utils import SYSTEM_PROMPTS

            if self.system_prompt and self.system_prompt not in SYSTEM_PROMPTS:
                raise ValueError(
                    f"system_prompt must be one of {sorted(SYSTEM_PROMPTS)} or '' (none), "
                    f"got {self.system_prompt!r}"
                )
            if self.size < 1:
                raise ValueError(f"size must be >= 1 (the pool of item indices), got {self.size}")
            try:
                if hasattr(base, "validate"):
                    base.validate(self)
            except AssertionError as e:  # reasoning-gym validates with assert
                raise ValueError(str(e) or f"{base.__name__}.validate() failed") from e

    return HubConfig


class ReasoningGymEnv(MessageEnv):
    """One turn: the question goes out, the reply is scored by the rubric."""

    def __init__(self, messages: list[Message]):
        self.messages = messages

    async def init(self) -> list[Message]:
        return list(self.messages)

    async def step(self, assistant_message: str) -> StepResult:
        return StepResult(messages=[], done=True)


class ReasoningGym(Environment):
    """The adapter; `reasoning_gym_environment(dataset)` makes its per-dataset subclass."""

    dataset_name: ClassVar[str] = ""
    """The key of `reasoning_gym.factory.DATASETS`."""
    dataset_class: ClassVar[type]
    """The dataset, a `reasoning_gym.dataset.ProceduralDataset` subclass."""
    dataset_config: ClassVar[type]
    """The dataset's own config dataclass (`config_class` adds our keys to it)."""

    def __init__(self, config: EnvConfig, seed: int, args: Any = None):
        super().__init__(config, seed, args)
        base = self.dataset_config
        values = {f.name: getattr(self.args, f.name) for f in dataclasses.fields(base)}
        if values["seed"] is None:
            values["seed"] = seed
        self.dataset = self.dataset_class(config=base(**values))
        self.size: int = values["size"]
        self._entry = lru_cache(maxsize=ENTRY_CACHE)(self.dataset.__getitem__)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as what builds it (its class is made at run time and its entry cache does
        not pickle), so env.workers processes can run its rubric."""
        args = {f.name: getattr(self.args, f.name) for f in dataclasses.fields(self.args)}
        return _rebuild, (self.dataset_name, self.config, self.seed, args)

    def _draw(self, rng: random.Random) -> dict[str, Any]:
        index = rng.randrange(self.size)
        entry = self._entry(index)
        answer = entry.get("answer")
        return {
            "index": index,
            "question": entry["question"],
            "answer": None if answer is None else str(answer),
        }

    def _sample(self, split: Split, index: int) -> dict[str, Any]:
        return split_sample(
            f"{HUB}/{self.dataset_name}",
            seed=self.dataset.seed,
            split=split,
            index=index,
            draw=self._draw,
            content=lambda s: s["question"],
        )

    def train_sample(self, index: int) -> dict[str, Any]:
        return self._sample("train", index)

    def validation_samples(self, n: int) -> list[dict[str, Any]]:
        return [self._sample("validation", i) for i in range(n)]

    def _prompt(self, sample: dict[str, Any]) -> list[Message]:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        key = self.args.system_prompt
        system = [{"role": "system", "content": SYSTEM_PROMPTS[key]}] if key else []
        return [*system, {"role": "user", "content": sample["question"]}]

    def make_env(self, sample: dict[str, Any]) -> ReasoningGymEnv:
        return ReasoningGymEnv(self._prompt(sample))

    def score(self, rollout: Rollout) -> float:
        """The dataset's `score_answer` on the last <answer> block of the reply (None when
        there is none, which its scorers score 0); a rollout with no turn scores 0. A scorer that
        raises on the reply scores 0 too, as a wrong answer (`WrongAnswer`)."""
        from reasoning_gym.utils import extract_answer

        if not rollout.turns:
            return 0.0
        answer = extract_answer(rollout.turns[-1].assistant_text)
        entry = self._entry(rollout.sample["index"])
        try:
            return float(self.dataset.score_answer(answer, entry))
        except Exception as e:  # a malformed reply: prime_factorization's int() on "seven"
            raise WrongAnswer(f"{type(e).__name__}: {e}") from e

    def rubric(self) -> Rubric:
        return Rubric([(SCORE, self.score, 1.0)])

    def demonstration(self, sample: dict[str, Any]) -> list[Message]:
        if sample["answer"] is None:
            raise ValueError(
                f"{HUB}:{self.dataset_name} item {sample['index']} has no gold answer to "
                "demonstrate; set warm_start.steps = 0"
            )
        reply = f"<answer>{sample['answer']}</answer>"
        return [*self._prompt(sample), {"role": "assistant", "content": reply}]


def _rebuild(dataset: str, config: EnvConfig, seed: int, args: dict[str, Any]) -> ReasoningGym:
    cls = reasoning_gym_environment(dataset)
    return cls(config, seed, cls.config_class(**args))
