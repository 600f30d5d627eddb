"""Rollouter: plays groups of sibling rollouts against a GenerateFn and scores them.

Naming (stable, so a router can keep a rollout's turns on one generator and runs replay):
    session_id = "step={step}/group={G}/rollout={R}"
    request_id = f"{session_id}/turn={T}"
    seed       = request_seed(seed, step, G, R, T)   # 63-bit hash, independent of timing

Group ids number the groups of one step in sampling order (0, 1, ...), across refill rounds.
A rollout that ends in an error status keeps reward 0.0 and advantage 0.0 but is flagged by
its status; it is counted in metrics and never trained on. A reward that is not finite or
is beyond +-REWARD_BOUND (1e6) is such an error (ERROR_REWARD).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from torchtitan_rl.envs.base import EpisodeEnvironment, draw_train_sample
from torchtitan_rl.rollout.advantages import group_has_signal
from torchtitan_rl.rollout.env_calls import EnvCallFailed, EnvCalls, LocalCalls
from torchtitan_rl.rollout.env_turn import describe_exception
from torchtitan_rl.rollout.env_workers import EnvWorkers
from torchtitan_rl.rollout.rollout_config import RolloutConfig
from torchtitan_rl.rollout.token_env import TokenEnv, TokenEnvError
from torchtitan_rl.types import (
    EndsSessions,
    GenerateFn,
    Rollout,
    RolloutGroup,
    RolloutStatus,
    RolloutTurn,
    SamplingParams,
    every_rollout_errored,
)

if TYPE_CHECKING:
    from torchtitan_rl.envs.base import EnvConfig, Environment
    from torchtitan_rl.models.renderer import Renderer

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1  # seeds fit a signed int64 (torch.Generator.manual_seed)
REWARD_BOUND = 1e6
"""Largest |reward| a rollout may score (each rubric function and their weighted sum); past
it the rollout is ERROR_REWARD, like a NaN. Rewards are O(1) in every recipe, so a score
this large is taken for a bug in the reward function; the bound also keeps every mean
over rollouts finite (a reward of 1e308 made the step's mean overflow to inf)."""
PlayGroup = Callable[..., Awaitable[RolloutGroup]]
"""`play_group(sample, *, group_id, step)`: one group played and scored."""
REFILL_MAX_FACTOR = 4
"""A refill round samples at most this many times the groups still missing."""


@dataclass(kw_only=True, slots=True)
class CollectedBatch:
    """One step's rollouts: `groups` train; `filtered` had no reward spread (or errored);
    `surplus` had spread but came after the batch was full (the last refill round's extra)."""

    groups: list[RolloutGroup]
    next_index: int
    """The next unused training sample index."""
    rounds: int
    """Sampling rounds it took: 1, plus one per refill round."""
    filtered: list[RolloutGroup]
    surplus: list[RolloutGroup] = field(default_factory=list)
    stale: list[RolloutGroup] = field(default_factory=list)
    """Groups taken out of `groups` for a token older than rollout.max_staleness allows."""

    def sampled(self) -> list[RolloutGroup]:
        """Every group of the step in sampling order (group ids count in that order)."""
        groups = [*self.groups, *self.stale, *self.filtered, *self.surplus]
        return sorted(groups, key=lambda g: g.group_id)


def session_id_for(*, step: int, group_id: int, rollout_id: int) -> str:
    return f"step={step}/group={group_id}/rollout={rollout_id}"


def request_id_for(session_id: str, turn: int) -> str:
    return f"{session_id}/turn={turn}"


def request_seed(seed: int, step: int, group_id: int, rollout_id: int, turn: int) -> int:
    """A 63-bit sampling seed that depends only on its arguments (not on timing or order)."""
    key = f"{seed}/{step}/{group_id}/{rollout_id}/{turn}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


class Rollouter:
    """Runs rollouts for the controller; holds no tensors, only envs and the rubric."""

    def __init__(
        self,
        environment: Environment,
        renderer: Renderer,
        env_config: EnvConfig,
        config: RolloutConfig,
        seed: int,
    ) -> None:
        config.validate()
        self._environment = environment
        self._renderer = renderer
        self._env_config = env_config
        self._config = config
        self._seed = seed
        self._rubric = environment.rubric()
        timeout_s = env_config.step_timeout_s
        self._calls: EnvCalls = (
            EnvWorkers(env_config.workers, self._rubric, renderer, timeout_s=timeout_s)
            if env_config.workers
            else LocalCalls(timeout_s, self._rubric, renderer)
        )
        """Where env turns (with their tokenizing) and scoring run: this event loop, or
        env.workers processes."""
        self.stop_sequences = tuple(renderer.stop_sequence(s) for s in config.stop)
        self._fewest_kept: int | None = None
        """The fewest groups a step kept after its refills, once a step fell short: the
        warning is said again only when a step keeps fewer (a run may fall short every step)."""

    async def run_single_rollout(
        self,
        sample: dict[str, Any],
        generate_fn: GenerateFn,
        *,
        group_id: int,
        rollout_id: int,
        sampling: SamplingParams,
        step: int = 0,
    ) -> Rollout:
        """Play one rollout to the end, then score it.

        `sampling` is the template for every turn: its seed is replaced per turn by
        `request_seed(...)`, and max_tokens is capped by the rollout's remaining token budget.
        """
        session_id = session_id_for(step=step, group_id=group_id, rollout_id=rollout_id)
        rollout = Rollout(
            group_id=group_id, rollout_id=rollout_id, session_id=session_id, sample=sample
        )
        if isinstance(self._environment, EpisodeEnvironment):
            return await self._play_episode(rollout, generate_fn, sampling=sampling, step=step)
        try:
            message_env = self._environment.make_env(sample)
        except Exception as e:  # a user env failing is recorded on the rollout, not fatal
            return _fail(
                rollout, RolloutStatus.ERROR_ENV, describe_exception(e), traceback.format_exc()
            )
        env = TokenEnv(message_env, self._renderer, self._env_config, self._calls)
        try:
            prompt_ids = await env.reset()
        except TokenEnvError as e:
            return _fail(rollout, e.status, str(e), e.details)

        try:
            status = await self._play_turns(
                rollout, env, prompt_ids, generate_fn, sampling=sampling, step=step
            )
        finally:  # a session's turns are all in _play_turns
            if isinstance(generate_fn, EndsSessions):
                generate_fn.end_session(session_id)
        rollout.messages = list(env.messages)
        rollout.status = status
        if not status.is_error():
            await self._score(rollout)
        return rollout

    async def _play_episode(
        self,
        rollout: Rollout,
        generate_fn: GenerateFn,
        *,
        sampling: SamplingParams,
        step: int,
    ) -> Rollout:
        """An EpisodeEnvironment's rollout: its own runner plays it, then it is scored."""
        environment = self._environment
        assert isinstance(environment, EpisodeEnvironment)

        def seed_of_turn(turn: int) -> int:
            return request_seed(self._seed, step, rollout.group_id, rollout.rollout_id, turn)

        try:
            await environment.play(
                rollout,
                generate_fn,
                renderer=self._renderer,
                sampling=sampling,
                seed_of_turn=seed_of_turn,
            )
        except Exception as e:  # a hub's runner failing is recorded on the rollout, not fatal
            return _fail(
                rollout, RolloutStatus.ERROR_ENV, describe_exception(e), traceback.format_exc()
            )
        finally:
            if isinstance(generate_fn, EndsSessions):
                generate_fn.end_session(rollout.session_id)
        if not rollout.status.is_error():
            await self._score(rollout)
        return rollout

    async def _play_turns(
        self,
        rollout: Rollout,
        env: TokenEnv,
        prompt_ids: np.ndarray,
        generate_fn: GenerateFn,
        *,
        sampling: SamplingParams,
        step: int,
    ) -> RolloutStatus:
        """Alternate generator and env until the rollout ends; appends turns to `rollout`."""
        max_rollout_tokens = self._env_config.max_rollout_tokens
        if prompt_ids.shape[0] >= max_rollout_tokens:  # TokenEnv checks every later prompt
            raise ValueError(
                f"env.max_rollout_tokens={max_rollout_tokens} leaves no room to generate after "
                f"the first prompt of sample {rollout.sample!r} ({prompt_ids.shape[0]} tokens); "
                "raise it above the longest first prompt"
            )
        turn = 0
        while True:
            turn_sampling = replace(
                sampling,
                max_tokens=min(sampling.max_tokens, max_rollout_tokens - prompt_ids.shape[0]),
                seed=request_seed(self._seed, step, rollout.group_id, rollout.rollout_id, turn),
            )
            completion = await generate_fn(
                prompt_ids,
                request_id=request_id_for(rollout.session_id, turn),
                session_id=rollout.session_id,
                sampling=turn_sampling,
            )
            result = await env.step(completion)
            if result.status is not RolloutStatus.ERROR_GENERATOR:
                assert completion is not None
                rollout.turns.append(
                    RolloutTurn(
                        prompt_ids=prompt_ids,
                        completion=completion,
                        assistant_text=result.assistant_text,
                        env_messages=result.env_messages,
                        reward_signals=result.reward_signals,
                    )
                )
            if result.done:
                assert result.status is not None
                rollout.error, rollout.error_details = result.error, result.error_details
                return result.status
            assert result.next_prompt_ids is not None
            prompt_ids = result.next_prompt_ids
            turn += 1

    async def _score(self, rollout: Rollout) -> None:
        try:
            reward, breakdown, rollout.scorer_error = await self._calls.score(rollout)
        except EnvCallFailed as e:  # a failing reward fn marks the rollout, never a silent 0
            _fail(rollout, RolloutStatus.ERROR_REWARD, e.error, e.details)
            return
        except TimeoutError as e:  # only a worker process bounds scoring; its line says how
            _fail(rollout, RolloutStatus.ERROR_TIMEOUT, str(e))
            return
        error = _reward_error(reward, breakdown)
        if error is not None:
            _fail(rollout, RolloutStatus.ERROR_REWARD, error)
            return
        rollout.reward = float(reward)
        rollout.reward_breakdown = {k: float(v) for k, v in breakdown.items()}

    def close(self) -> None:
        """Stop the env worker processes (env.workers > 0); nothing is left running."""
        self._calls.close()

    async def run_group_rollouts(
        self, sample: dict[str, Any], generate_fn: GenerateFn, *, group_id: int, step: int
    ) -> RolloutGroup:
        """Run `group_size` sibling rollouts of one prompt concurrently."""
        sampling = self._config.sampling_params(
            seed=0,
            max_tokens=self._config.max_tokens,
            stop_token_ids=tuple(self._renderer.stop_token_ids),
            stop_sequences=self.stop_sequences,
        )
        rollouts = await asyncio.gather(
            *(
                self.run_single_rollout(
                    sample,
                    generate_fn,
                    group_id=group_id,
                    rollout_id=rollout_id,
                    sampling=sampling,
                    step=step,
                )
                for rollout_id in range(self._config.group_size)
            )
        )
        return RolloutGroup(group_id=group_id, rollouts=list(rollouts))

    async def collect_batch(
        self,
        step: int,
        next_sample_index: int,
        generate_fn: GenerateFn,
        *,
        draw: Callable[[int], list[int]] | None = None,
        play_group: PlayGroup | None = None,
    ) -> CollectedBatch:
        """Sample prompts until `prompts_per_step` groups survive filtering.

        Returns the kept groups, the next unused sample index, the rounds taken and the groups
        filtered out (errored rollouts among them are reported, not lost). An environment
        that cannot give a sample raises SampleError (envs/base.py): that ends the run. After
        `max_sampling_rounds` refill rounds, or (1 + max_sampling_rounds) * prompts_per_step
        groups, it warns and returns what it has, which may be fewer groups or none at all.
        Each round's prompts are `draw(n)` (a PromptLedger's), or the next consecutive
        indices from `next_sample_index` without one. Each group is played by
        `play_group(sample, group_id=, step=)` (the rollout processes'), or here through
        `generate_fn` without one.
        """
        cfg = self._config
        if play_group is None:
            play_group = functools.partial(self.run_group_rollouts, generate_fn=generate_fn)
        kept: list[RolloutGroup] = []
        sampled: list[RolloutGroup] = []
        index = next_sample_index
        rounds = 0
        budget = (1 + cfg.max_sampling_rounds) * cfg.prompts_per_step  # groups, at most
        while (
            len(kept) < cfg.prompts_per_step
            and rounds <= cfg.max_sampling_rounds
            and len(sampled) < budget
        ):
            size = min(
                refill_size(cfg.prompts_per_step - len(kept), len(sampled), len(kept)),
                budget - len(sampled),
            )
            first_group = len(sampled)
            if draw is None:
                indices, index = list(range(index, index + size)), index + size
            else:
                indices = draw(size)
            # every sample before any coroutine exists: a failing one leaves none unawaited
            samples = [draw_train_sample(self._environment, i) for i in indices]
            groups = await asyncio.gather(
                *(
                    play_group(sample, group_id=first_group + i, step=step)
                    for i, sample in enumerate(samples)
                )
            )
            for group, sample_index in zip(groups, indices, strict=True):
                group.sample_index = sample_index
            rounds += 1
            sampled.extend(groups)
            kept.extend(g for g in groups if not cfg.filter_zero_std_groups or group_has_signal(g))
        kept, surplus = kept[: cfg.prompts_per_step], kept[cfg.prompts_per_step :]
        short_of = cfg.prompts_per_step if self._fewest_kept is None else self._fewest_kept
        if len(kept) < short_of and not every_rollout_errored(sampled):
            self._fewest_kept = len(kept)
            logger.warning(
                "step %d: only %d of %d groups have reward spread after %d refill rounds "
                "(rollout.max_sampling_rounds=%d); training on what there is (said again only "
                "if a step keeps fewer)",
                step, len(kept), cfg.prompts_per_step, rounds - 1, cfg.max_sampling_rounds,
            )  # fmt: skip
        used = [*kept, *surplus]
        filtered = [g for g in sampled if not any(g is k for k in used)]
        return CollectedBatch(
            groups=kept, next_index=index, rounds=rounds, filtered=filtered, surplus=surplus
        )


def refill_size(need: int, sampled: int, kept: int) -> int:
    """Groups to sample for `need` more with reward spread: all of them in the first round,
    then `need` over the share kept so far (floored at 1 / REFILL_MAX_FACTOR), so that one
    refill round does the work of several ever smaller ones."""
    if sampled == 0:
        return need
    if REFILL_MAX_FACTOR * kept < sampled:
        return REFILL_MAX_FACTOR * need
    return -(-need * sampled // kept)  # ceil(need * sampled / kept) in integers


def _reward_error(reward: float, breakdown: dict[str, float]) -> str | None:
    """Why a score may not be trained on (None if it may): each rubric function's value and
    their weighted sum must be finite and within +-REWARD_BOUND."""
    scores = {f"rubric function {k!r}": v for k, v in breakdown.items()}
    scores["the weighted sum"] = reward
    for what, value in scores.items():
        if not math.isfinite(value):
            return f"non-finite reward {value!r} from {what}"
        if abs(value) > REWARD_BOUND:
            return f"reward {value!r} from {what} is beyond REWARD_BOUND = {REWARD_BOUND:g}"
    return None


def _fail(
    rollout: Rollout, status: RolloutStatus, error: str, details: str | None = None
) -> Rollout:
    assert status.is_error()
    rollout.status = status
    rollout.error = error
    rollout.error_details = details
    rollout.reward = 0.0
    rollout.reward_breakdown = {}
    return rollout
