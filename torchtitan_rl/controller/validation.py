"""Greedy validation: one rollout per validation sample, logged as validation_reward/*."""

from __future__ import annotations

import asyncio

from torchtitan_rl.config.job import ValidationConfig
from torchtitan_rl.controller.diagnostics import StepDiagnostics
from torchtitan_rl.controller.metrics import MetricsLogger, validation_metrics
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.types import GenerateFn, RolloutGroup, SamplingParams


async def validate(
    config: ValidationConfig, step: int, *, rollouter: Rollouter, renderer: Renderer,
    environment, generate_fn: GenerateFn, diagnostics: StepDiagnostics,
    metrics: MetricsLogger,
) -> float:  # fmt: skip
    """Run `validation.num_samples` greedy rollouts through `generate_fn` after RL `step`,
    report and log them; returns validation_reward/mean (NaN without samples)."""
    samples = environment.validation_samples(config.num_samples)
    greedy = SamplingParams(
        temperature=0.0,
        max_tokens=config.max_tokens,
        stop_token_ids=tuple(renderer.stop_token_ids),
        stop_sequences=rollouter.stop_sequences,
    )
    rollouts = await asyncio.gather(
        *(
            rollouter.run_single_rollout(
                s, generate_fn, group_id=i, rollout_id=0, sampling=greedy, step=-1
            )
            for i, s in enumerate(samples)
        )
    )
    diagnostics.report(step, [RolloutGroup(group_id=0, rollouts=rollouts)], training=False)
    scalars = validation_metrics(rollouts)
    metrics.log(scalars, step)
    return scalars.get("validation_reward/mean", float("nan"))
