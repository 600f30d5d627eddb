"""The warm start: supervised steps on the environment's demonstrations before RL, until
`warm_start.steps` or until the mean loss of the last steps reaches `warm_start.target_loss`.

Demonstrations come from training samples at negative indices (-1, -2, ...), so they never
overlap the RL prompts (0, 1, ...). Metrics are logged at steps <= 0: the last warm-start
step at 0, RL from 1.
"""

from __future__ import annotations

import logging

from torchtitan_rl.config import Config
from torchtitan_rl.controller.progress import progress_bar
from torchtitan_rl.envs.base import draw_train_sample
from torchtitan_rl.rollout.episodes import demonstration_episodes, longest_run
from torchtitan_rl.training.trainer_config import (
    TARGET_LOSS_WINDOW,
    WarmStartConfig,
    recent_mean,
)

logger = logging.getLogger(__name__)

LOG_EVERY = 10
"""Warm-start metrics are logged every this many steps, and at the last one."""


def check_demonstrations_fit(cfg: Config, environment, renderer) -> None:
    """Before any process starts: a warm start whose demonstrations never fit a row
    would train on nothing (ValueError naming batcher.seq_len)."""
    samples = [draw_train_sample(environment, -1 - i) for i in range(cfg.warm_start.batch_size)]
    episodes = demonstration_episodes(environment, renderer, samples)
    lengths = [len(e) for e in episodes]
    limit = cfg.batcher.seq_len + 1
    if not any(n <= limit for n in lengths):
        raise ValueError(
            f"batcher.seq_len={cfg.batcher.seq_len} fits episodes of up to {limit} tokens, "
            f"but no warm-start demonstration does ({min(lengths)} to {max(lengths)} tokens "
            f"in the first batch); raise batcher.seq_len or set warm_start.steps = 0"
        )
    turns = [longest_run(e.loss_mask_L) for e in episodes]
    for key, limit in (
        ("rollout.max_tokens", cfg.rollout.max_tokens),
        ("validation.max_tokens", cfg.validation.max_tokens),
    ):
        over = sum(n > limit for n in turns)
        if over:
            logger.warning(
                    "%d of %d warm-start demonstrations have an assistant turn longer than "
                    "%s=%d (up to %d tokens): replies like them will be cut off; raise %s",
                    over, len(turns), key, limit, max(turns), key,
                )  # fmt: skip


def warm_start_notice(cfg: Config, environment) -> str | None:
    """One line when the warm start does not fit the model a run starts from: a random
    model without one scores ~0 (nothing for RL to learn from; an environment without
    demonstrations, e.g. a verifiers taskset, needs model.hf_checkpoint instead), and one
    loaded from model.hf_checkpoint still gets one unless warm_start.steps = 0."""
    if cfg.training.steps == 0:
        return None
    if cfg.model.hf_checkpoint and cfg.warm_start.steps:
        trains = ""
        if cfg.lora.enabled:
            every = cfg.warm_start.trains_all(lora=True, hf_checkpoint=cfg.model.hf_checkpoint)
            what = "every weight" if every else "the LoRA adapters only"
            trains = f", training {what} (warm_start.params={cfg.warm_start.params!r})"
        return (
            f"model.hf_checkpoint={cfg.model.hf_checkpoint!r}: the warm start still runs (up to "
            f"warm_start.steps={cfg.warm_start.steps}) on these weights before RL{trains}; set "
            "warm_start.steps = 0 to start RL from them as they are"
        )
    if not cfg.model.hf_checkpoint and not cfg.warm_start.steps:
        if environment.has_demonstrations():
            return (
                "a random-init model starts RL without a warm start (warm_start.steps = 0) and "
                f"will earn ~0 reward, though env.name={cfg.env.name!r} has demonstrations; "
                'set warm_start.steps (e.g. extends = "alphabet_sort_tiny.toml": 400 steps up '
                "to warm_start.target_loss)"
            )
        return (
            "a random-init model starts RL without a warm start and will earn ~0 reward: "
            f"env.name={cfg.env.name!r} has no demonstrations to warm it up; set "
            "model.hf_checkpoint to a model that can already attempt the task (a Qwen3 folder)"
        )
    return None


async def run_warm_start(
    ws: WarmStartConfig, *, environment, renderer, pack, trainer, metrics, supervisor,
    use_tqdm: bool,
) -> int:  # fmt: skip
    """Run the warm start's SFT steps on `trainer`; returns how many ran. `pack(episodes)`
    packs a batch the way RL steps are packed."""
    losses: list[float] = []
    with progress_bar(ws.steps, use_tqdm and ws.steps > 0, "warm start") as bar:
        for step in range(1, ws.steps + 1):
            supervisor.where = f"during warm-start step {step}"
            first = (step - 1) * ws.batch_size
            samples = [draw_train_sample(environment, -1 - first - i) for i in range(ws.batch_size)]
            batches, _ = pack(demonstration_episodes(environment, renderer, samples))
            out = await trainer.sft_step.call(batches, ws)
            step_metrics = next(iter(out.values()))
            losses.append(step_metrics["warm_start/loss"])
            done = step == ws.steps or ws.reached_target(losses)
            if done:
                step_metrics = {**step_metrics, "warm_start/steps": step}
            if step % LOG_EVERY == 0 or done:
                metrics.log(step_metrics, step - ws.steps)  # warm start logs at steps <= 0
            bar.update(1)
            bar.set_postfix(loss=f"{step_metrics['warm_start/loss']:.3f}")
            if done:
                bar.total = step  # an early stop ends the bar full
                bar.refresh()
                break
    if ws.target_loss > 0 and losses:
        _report_target_loss(ws, losses)
    return len(losses)


def _report_target_loss(ws: WarmStartConfig, losses: list[float]) -> None:
    mean, window = recent_mean(losses), min(len(losses), TARGET_LOSS_WINDOW)
    if ws.reached_target(losses):
        logger.warning(
            "warm start stopped after %d of at most %d steps: mean loss %.3f of the last %d "
            "reached warm_start.target_loss=%g", len(losses), ws.steps, mean, window,
            ws.target_loss,
        )  # fmt: skip
    else:
        logger.warning(
            "warm start ran all %d steps: mean loss %.3f of the last %d stayed above "
            "warm_start.target_loss=%g; RL starts from here (raise warm_start.steps to go on)",
            ws.steps, mean, window, ws.target_loss,
        )  # fmt: skip
