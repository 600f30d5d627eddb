"""What an RL environment provides: datasets, per-rollout chat envs and a reward rubric.

A user writes two classes, in any importable module (`[env] name = "pkg.module:MyEnv"`).
`MessageEnv` plays one rollout as a chat: `init` returns the opening messages, `step` takes
the assistant's text and returns the env's reply. An `Environment` makes the samples those
envs are played on (`train_sample`, `validation_samples`), the envs themselves
(`make_env`), the `Rubric` that turns a finished `Rollout` into its reward (`rubric`), and,
optionally, gold conversations for the supervised warm start (`demonstration`). Its own
settings are a dataclass named by `config_class`, filled from the `[env.args]` table.
An `EpisodeEnvironment` instead plays each rollout with its own episode runner (a hub's,
such as verifiers'), calling the generator itself.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from torchtitan_rl.types import GenerateFn, Message, Rollout, SamplingParams

if TYPE_CHECKING:
    from torchtitan_rl.models.renderer import Renderer


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    """The `[env]` section: which environment and the limits of one rollout."""

    name: str = "alphabet_sort"
    """A built-in environment (a key of `torchtitan_rl.envs.ENVS`) or the import path of an
    `Environment` subclass, "package.module:ClassName" (importable from the working
    directory or PYTHONPATH)."""
    max_turns: int = 1
    """Assistant turns per rollout, >= 1."""
    max_rollout_tokens: int = 512
    """Token budget of one rollout: the first prompt plus every completion and env reply, >= 1."""
    step_timeout_s: float = 30.0
    """Seconds one `MessageEnv.init` or `step` call may take before the rollout errors, > 0."""
    workers: int = 0
    """Worker processes that run `MessageEnv.init` / `step` with the tokenizing of each turn
    (decoding the completion, encoding the env's reply) and the rubric's scoring, >= 0.
    0: on the controller's event loop. N: in N processes, so pure-Python steps and scorers
    that cost milliseconds (a reasoning-gym scorer) and the tokenizer's work of many
    concurrent rollouts run in parallel and the loop stays free to serve the generators; the
    rubric, the renderer and each MessageEnv must pickle (each call carries its env there
    and back). There, init and step are bounded by step_timeout_s as on the loop, and a
    call stuck past step_timeout_s + 1 s (a step that holds its thread, a turn's tokenizing,
    a score) kills its worker (replaced) and errors only its own rollout. An env that waits
    on I/O with `await` gains nothing from it. With rollout.processes = K, each rollout
    process has N workers of its own (K * N in all). Measured in docs/benchmarks.md (env
    steps, the controller's turn rate)."""
    args: dict[str, Any] = field(default_factory=dict)
    """The environment's own settings (TOML table [env.args], overrides --env.args.key=v),
    checked against its `config_class`; unset keys keep that dataclass's defaults."""

    def validate(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns}")
        if self.max_rollout_tokens < 1:
            raise ValueError(f"env.max_rollout_tokens must be >= 1, got {self.max_rollout_tokens}")
        if not (self.step_timeout_s > 0 and math.isfinite(self.step_timeout_s)):
            raise ValueError(
                f"env.step_timeout_s must be a finite number > 0, got {self.step_timeout_s}"
            )
        if self.workers < 0:
            raise ValueError(f"env.workers must be >= 0 (0: on the event loop), got {self.workers}")


@dataclass(kw_only=True, slots=True)
class StepResult:
    """The env's answer to one assistant message."""

    messages: list[Message]
    """The env's reply (usually one user message); empty when done."""
    done: bool
    """True once the episode is over; `step` is not called again."""
    reward_signals: dict[str, float] = field(default_factory=dict)
    """Per-turn signals the rubric may read back, e.g. {"turn_score": 0.8}."""


class MessageEnv(ABC):
    """One rollout's chat partner; a fresh instance per rollout, so it may keep state."""

    @abstractmethod
    async def init(self) -> list[Message]:
        """The opening messages (system and/or user) the first prompt is rendered from."""

    @abstractmethod
    async def step(self, assistant_message: str) -> StepResult:
        """React to the assistant's text (its stop token already removed)."""


RewardFn = Callable[[Rollout], float]
"""Scores a finished rollout; may read `rollout.sample` and `rollout.turns[i].reward_signals`."""


class WrongAnswer(Exception):
    """Raised by a reward function whose scorer rejected the reply by raising (a
    reasoning-gym scorer's ValueError on a reply that is not a number): the function scores 0
    as for any wrong answer and the rollout trains on it, where any other exception makes it
    ERROR_REWARD. Its message, `rollout.scorer_error`, is counted per step in
    rollout/scorer_raised; a step in which every rollout errored or raised this still counts
    toward rollout.max_error_steps, so a scorer that always raises stops the run.

        try:
            return float(dataset.score_answer(answer, entry))
        except Exception as e:  # the dataset's way of saying "wrong"
            raise WrongAnswer(f"{type(e).__name__}: {e}") from e
    """


RESERVED_NAMES = frozenset({"mean", "std", "zero_std_frac"})
"""Rubric names that would overwrite the reward metrics of the same name."""


class Rubric:
    """A weighted sum of named reward functions.

    A raising function propagates: the caller marks the rollout ERROR_REWARD rather than
    training on a made-up score. So does a value, or weighted sum, that is not finite or
    beyond +-1e6 (`rollout.rollouter.REWARD_BOUND`). The one exception is `WrongAnswer`.
    """

    def __init__(self, funcs: Sequence[tuple[str, RewardFn, float]]):
        if not funcs:
            raise ValueError("Rubric needs at least one (name, fn, weight), got none")
        names = [name for name, _, _ in funcs]
        if len(set(names)) != len(names):
            raise ValueError(f"Rubric function names must be unique, got {names}")
        for name, _, weight in funcs:
            if name in RESERVED_NAMES or re.fullmatch(r"turn_\d+", name):
                raise ValueError(
                    f"Rubric function name {name!r} is taken by a metric "
                    f"(validation_reward/{name}); reserved: mean, std, zero_std_frac, turn_<n>"
                )
            if not math.isfinite(weight):
                raise ValueError(f"Rubric weight of {name!r} must be finite, got {weight}")
        self.funcs = tuple(funcs)

    def score(self, rollout: Rollout) -> tuple[float, dict[str, float]]:
        """(weighted sum, {name: unweighted value}); a function that raised `WrongAnswer`
        counts 0 and leaves its line in `rollout.scorer_error`."""
        breakdown, raised = {}, None
        for name, fn, _ in self.funcs:
            try:
                breakdown[name] = float(fn(rollout))
            except WrongAnswer as e:
                breakdown[name] = 0.0
                raised = raised or f"{name}: {e}"
        total = sum(weight * breakdown[name] for name, _, weight in self.funcs)
        rollout.scorer_error = raised
        return total, breakdown


class Environment(ABC):
    """Builds the data, per-rollout envs and rubric of one environment.

    Samples are plain dicts (they travel inside `Rollout.sample`); training and
    validation samples never coincide. The warm start asks for `train_sample` at negative
    indices (-1, -2, ...), so its samples are not the RL steps' samples.
    """

    config_class: ClassVar[type | None] = None
    """Dataclass of this environment's settings ([env.args]); None: it takes none. A
    `validate()` method on it, when present, runs before the environment is built."""

    def __init__(self, config: EnvConfig, seed: int, args: Any = None):
        """`args`: an instance of `config_class` (None: its defaults)."""
        config.validate()
        self.config = config
        self.seed = seed
        if args is None and self.config_class is not None:
            args = self.config_class()
        if self.config_class is not None and not isinstance(args, self.config_class):
            raise ValueError(
                f"{type(self).__name__} takes env.args as a {self.config_class.__name__}, "
                f"got {type(args).__name__}"
            )
        if hasattr(args, "validate"):
            args.validate()
        self.args = args

    @abstractmethod
    def train_sample(self, index: int) -> dict[str, Any]:
        """Training sample `index` (any integer); the same for the same (seed, index)."""

    @abstractmethod
    def validation_samples(self, n: int) -> list[dict[str, Any]]:
        """The first `n` of a fixed held-out set: the same list on every call."""

    @abstractmethod
    def make_env(self, sample: dict[str, Any]) -> MessageEnv:
        """A fresh env that plays `sample`."""

    @abstractmethod
    def rubric(self) -> Rubric:
        """How a finished rollout is scored. It scores every rollout that did not error,
        truncated ones included (their last `step` may never have run), and its score is
        the reward: `StepResult.reward_signals` are only what the rubric may read."""

    def demonstration(self, sample: dict[str, Any]) -> list[Message]:
        """A gold conversation (every turn, correct assistant answers) for the supervised
        warm start. Optional: without it, run with `warm_start.steps = 0`."""
        raise NotImplementedError(f"{type(self).__name__} has no demonstrations")

    @classmethod
    def has_demonstrations(cls) -> bool:
        return cls.demonstration is not Environment.demonstration


class EpisodeEnvironment(Environment):
    """An Environment whose own episode runner plays each rollout (a hub's, such as
    verifiers'), calling `generate_fn` itself rather than answering turn by turn as a
    `MessageEnv` does. The Rollouter calls `play`, then scores the rollout with `rubric()`
    unless `play` gave it an error status."""

    @abstractmethod
    async def play(
        self,
        rollout: Rollout,
        generate_fn: GenerateFn,
        *,
        renderer: Renderer,
        sampling: SamplingParams,
        seed_of_turn: Callable[[int], int],
    ) -> None:
        """Play `rollout.sample` and fill `rollout`: `turns` (each turn's prompt ids, as
        `renderer` made them and the generator saw them, and its `Completion`; never
        re-tokenized text), `messages` and `status` (an error status with `error` set when
        the episode failed). `sampling` is the template of every request; the trained
        agent's turn T is named f"{rollout.session_id}/turn={T}" and sampled with seed
        `seed_of_turn(T)`."""

    def make_env(self, sample: dict[str, Any]) -> MessageEnv:
        raise TypeError(f"{type(self).__name__} plays its rollouts itself (play), no MessageEnv")


class SampleError(RuntimeError):
    """An environment could not give a training sample. Not a per-rollout error: without
    its data the run cannot go on (skipping the index would silently change the data)."""


def draw_train_sample(environment: Environment, index: int) -> dict[str, Any]:
    """`environment.train_sample(index)`, or SampleError naming the environment, the method
    and the index (with the environment's exception chained)."""
    where = f"{type(environment).__name__}.train_sample({index})"
    try:
        sample = environment.train_sample(index)
    except Exception as e:
        raise SampleError(f"{where} raised {type(e).__name__}: {e}") from e
    if not isinstance(sample, dict):
        raise SampleError(f"{where} returned {type(sample).__name__}; it must return a dict")
    return sample
