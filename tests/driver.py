"""The loop the end-to-end tests drive, once: start -> warm_start -> rl_step x N ->
validate -> close, as `Controller.run` does without checkpoints or progress bars.

    run = drive(config, steps=2, validate=True)
    assert [m["trainer/policy_version"] for m in run.steps] == [3, 4]
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Driven:
    """What a driven run leaves for the test to check."""

    steps: list[dict[str, float]]
    """Each RL step's metrics, as `Controller.rl_step` returned them."""
    validation: float | None
    """The mean validation reward after the last step; None unless asked for."""
    generator_version: int
    """The policy version the first generator holds after the last step (before close)."""
    run_dir: Path
    """The run's folder (rollout records, TensorBoard events, ...)."""


def drive(config, steps: int, *, validate: bool = False, warm_start: bool = True) -> Driven:
    """Run RL steps 1..`steps` of `config` through Monarch, then close every process (also
    when a step fails). `warm_start`: run the warm start first, as the CLI does;
    `validate`: one validation after the last step."""
    from torchtitan_rl.controller.loop import Controller

    async def run() -> Driven:
        controller = Controller(config, use_tqdm=False)
        try:
            await controller.start()
            if warm_start:
                await controller.warm_start()
            metrics = [await controller.rl_step(step) for step in range(1, steps + 1)]
            validation = None
            if validate:
                await controller.validate(steps)
                validation = controller.last_validation
            version = await controller.fleet.actors[0].policy_version.call_one()
            return Driven(metrics, validation, version, controller.run_dir)
        finally:
            await controller.close()

    return asyncio.run(run())
