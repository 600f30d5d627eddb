"""The [rollout] section: how many rollouts a step plays, how they sample, how batches run
ahead of training and where the rollouts are played (`rollout.processes`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from torchtitan_rl.checks import check_range
from torchtitan_rl.types import SamplingParams


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """TOML section [rollout]."""

    group_size: int = 8
    """Sibling rollouts per prompt, >= 2 when training.steps > 0 (a group-relative advantage
    needs siblings); 1 is allowed only with training.steps = 0 (validation only)."""
    prompts_per_step: int = 8
    """Groups (prompts) trained on per step (>= 1)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts, finite and > 0: the loss needs the log-probs of the
    distribution that sampled (validation decodes greedily on its own)."""
    top_p: float = 1.0
    """Nucleus mass kept, in (0, 1]; 1 disables."""
    top_k: int = 0
    """Most likely tokens kept (>= 0); 0 disables."""
    max_tokens: int = 64
    """Max tokens sampled per assistant turn (>= 1); also capped by the rollout token budget."""
    stop: list[str] = field(default_factory=list)
    """Texts that end an assistant turn (training and validation), e.g. ["</answer>"]: the
    turn stops once its tokens end with the tokenizer's ids of one, which stay in the
    completion and are trained on. Native generator only. The match is on those ids: a
    reply that spells the text with other tokens runs on, as without the key. The closing
    `<|im_end|>` after it is then never sampled, so RL does not train it."""
    filter_zero_std_groups: bool = True
    """Drop groups whose valid rollouts all got the same reward (no learning signal)."""
    max_sampling_rounds: int = 4
    """Extra prompt batches tried to refill filtered groups (>= 0) before training on what
    there is (with a warning). A refill round samples the missing groups divided by the share
    kept so far this step (at most 4x), so one refill does the work of several; a step samples
    at most (1 + max_sampling_rounds) * prompts_per_step groups in all."""
    max_staleness: int = 0
    """How many policy versions behind the policy being updated a trained token may be
    (>= 0). 0: synchronous steps (generate, then train, then sync). N >= 1: batches are
    generated while the trainer trains, up to N // training.minibatches steps ahead (a step
    moves the policy one version per minibatch); a group with an older token is dropped
    (counted in rollout/dropped_stale) and its prompt generated again. With
    loss.old_logprobs = "recompute" and no [correction], tokens are then weighted by
    min(pi_old / mu, 2) (docs/design.md, the three policies)."""
    ahead: Literal["pipelined", "streaming"] = "pipelined"
    """How batches run ahead when max_staleness >= 1. "pipelined": batches one after
    another, new weights sent only between two batches, so each batch comes from one known
    version and a seeded run replays bit for bit. "streaming": new weights sent right after
    every optimizer step (in-flight turns pick them up between engine steps) and batches
    may overlap: faster, not replayable."""
    max_error_steps: int = 5
    """Stop the run (exit code 1, one line) after this many consecutive RL steps in which
    every rollout errored (a reward function that always raises, an environment that always
    fails) or was scored 0 by a scorer that raised on it (`envs.base.WrongAnswer`): such a run
    trains on nothing. >= 0; 0 never stops."""
    processes: int = 0
    """Processes that play the rollouts (the step's groups and the validation samples), each
    with its own environment, tokenizer and env.workers, routing its turns over every
    generator replica (>= 0); 0: the controller's own event loop. At hundreds of concurrent
    multi-turn rollouts one loop cannot feed several generator GPUs (docs/benchmarks.md, "The
    controller's turn rate"). With processes >= 1 the controller's own env.workers never
    start."""
    batch_timeout_s: float = 1800.0
    """Seconds a step waits for its batch (and a validation for its rollouts) before the run
    stops with one line saying what the generators were doing (> 0); a slow or stuck
    environment or generator ends the run, never hangs it."""

    def validate(self) -> None:
        for name in ("group_size", "prompts_per_step", "max_tokens"):
            check_range(f"rollout.{name}", getattr(self, name), ge=1)
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"rollout.temperature must be finite and > 0 (training rollouts sample; "
                f"validation is greedy by itself), got {self.temperature}"
            )
        check_range("rollout.max_staleness", self.max_staleness, ge=0)
        check_range("rollout.processes", self.processes, ge=0)
        check_range("rollout.batch_timeout_s", self.batch_timeout_s, gt=0)
        check_range("rollout.max_sampling_rounds", self.max_sampling_rounds, ge=0)
        check_range("rollout.max_error_steps", self.max_error_steps, ge=0)
        try:
            self.sampling_params(seed=0, max_tokens=self.max_tokens, stop_token_ids=()).validate()
            if any(not s for s in self.stop):
                raise ValueError(
                    f"stop: an empty text would end every turn at once, got {self.stop}"
                )
        except ValueError as e:  # SamplingParams names the field; say which section it is in
            raise ValueError(f"rollout.{e}") from e

    def sampling_params(
        self,
        *,
        seed: int,
        max_tokens: int,
        stop_token_ids: tuple[int, ...],
        stop_sequences: tuple[tuple[int, ...], ...] = (),
    ) -> SamplingParams:
        # A truncated (top-p/top-k) sample is scored on its kept support; the trainer replays
        # that support so both sides of the importance ratio use the same distribution.
        truncated = self.temperature > 0 and (self.top_p < 1 or self.top_k > 0)
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            stop_sequences=stop_sequences,
            seed=seed,
            return_support=truncated,
        )
