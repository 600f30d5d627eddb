"""Greedy validation: one rollout per validation sample, logged as validation_reward/*.

With rollout.processes = K >= 1, sample i is played in rollout process i mod K (the fleet's
`play_single`), like the step's groups; else on this loop through the fleet's generate_fn.
Either way the rollouts are the same: greedy, and a request's tokens depend on its own
context only, not on which process sent it.
"""

from __future__ import annotations

import asyncio
import functools

from torchtitan_rl.config.job import ValidationConfig
from torchtitan_rl.controller.ahead import BatchTimeout
from torchtitan_rl.controller.diagnostics import StepDiagnostics
from torchtitan_rl.controller.fleet import GeneratorFleet
from torchtitan_rl.controller.metrics import MetricsLogger, validation_metrics
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.types import RolloutGroup, SamplingParams


async def validate(
    config: ValidationConfig, step: int, *, rollouter: Rollouter, renderer: Renderer,
    environment, fleet: GeneratorFleet, diagnostics: StepDiagnostics, metrics: MetricsLogger,
    timeout_s: float,
) -> float:  # fmt: skip
    """Run `validation.num_samples` greedy rollouts through the fleet after RL `step`,
    report and log them; returns validation_reward/mean (NaN without samples). BatchTimeout
    after `timeout_s` (rollout.batch_timeout_s) without them, naming what the generators do."""
    samples = environment.validation_samples(config.num_samples)
    greedy = SamplingParams(
        temperature=0.0,
        max_tokens=config.max_tokens,
        stop_token_ids=tuple(renderer.stop_token_ids),
        stop_sequences=rollouter.stop_sequences,
    )
    play = fleet.play_single or functools.partial(
        rollouter.run_single_rollout, generate_fn=fleet.generate_fn, rollout_id=0
    )
    playing = asyncio.gather(
        *(play(s, group_id=i, sampling=greedy, step=-1) for i, s in enumerate(samples))
    )
    try:
        done, _ = await asyncio.wait({playing}, timeout=timeout_s)
    finally:  # also when the run is cancelled meanwhile: its rollouts go with it
        if not playing.done():
            playing.add_done_callback(lambda f: f.cancelled() or f.exception())  # read
            playing.cancel()
    if not done:
        raise BatchTimeout(
            f"validation after RL step {step} unfinished after {timeout_s:g} s "
            f"(rollout.batch_timeout_s): {await fleet.activity()}"
        )
    rollouts = playing.result()
    diagnostics.report(step, [RolloutGroup(group_id=0, rollouts=rollouts)], training=False)
    scalars = validation_metrics(rollouts)
    metrics.log(scalars, step)
    return scalars.get("validation_reward/mean", float("nan"))
