"""Step metrics: computed from rollout records, written to TensorBoard and kept for the
summary. How values reduce is decided by `torchtitan_rl.reductions`, not here."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from torchtitan_rl.rollout.advantages import group_has_signal
from torchtitan_rl.rollout.episodes import count_branches
from torchtitan_rl.rollout.rollouter import CollectedBatch
from torchtitan_rl.types import Rollout, RolloutGroup, RolloutStatus


def summarize(prefix: str, values: Iterable[float]) -> dict[str, float]:
    """{prefix/mean, /std, /max} of finite values; nothing when there are none."""
    arr = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    if arr.size == 0:
        return {}
    return {f"{prefix}/mean": arr.mean(), f"{prefix}/std": arr.std(), f"{prefix}/max": arr.max()}


DASHBOARD = {
    "learning": {
        "reward (sampled rollouts)": ["Multiline", ["rollout_reward/mean"]],
        "validation (greedy, held-out)": ["Multiline", ["validation_reward/.*"]],
        "rubric functions (sampled rollouts)": ["Multiline", [r"rollout_reward/[^/]+/mean"]],
        "groups that teach nothing (share)": ["Multiline", ["rollout_reward/zero_std_frac"]],
        "loss": ["Multiline", ["loss/mean", "loss/policy"]],
        "kl and entropy": ["Multiline", ["loss/kl", "loss/entropy"]],
        "grad norm": ["Multiline", ["trainer/grad_norm"]],
    },
    "warm start": {
        "loss": ["Multiline", ["warm_start/loss"]],
        "grad norm": ["Multiline", ["warm_start/grad_norm"]],
    },
    "off-policy": {
        "generator vs trainer log-prob": [
            "Multiline",
            ["trainer/logprob_diff/mean", "trainer/logprob_diff/max"],
        ],
        # |log ratio|, not the ratio: ratios sit within 1e-6 of 1, where every tick reads 1.
        "|log ratio| (0 = same policy)": [
            "Multiline",
            [
                "loss/log_ratio/abs_mean",
                "loss/log_ratio/abs_max",
                "correction/log_ratio/abs_mean",
                "correction/log_ratio/abs_max",
            ],
        ],
        "clipped / corrected": [
            "Multiline",
            ["loss/clip_frac", "correction/truncated_frac", "correction/masked_frac"],
        ],
        "staleness (policy versions)": [
            "Multiline",
            ["rollout/staleness/mean", "rollout/staleness/max"],
        ],
    },
    "rollouts": {
        "status": ["Multiline", ["rollout/status/.*"]],
        "tokens and turns": ["Multiline", ["rollout/output_tokens/mean", "rollout/num_turns/mean"]],
        "seconds per step": [
            "Multiline",
            ["perf/step_seconds", "perf/generate_seconds", "perf/train_seconds"],
        ],
        "waiting (seconds per step)": [
            "Multiline",
            ["perf/trainer_wait_seconds", "perf/generator_wait_seconds"],
        ],
    },
}
"""TensorBoard's Custom Scalars tab: the curves a person looks at first (the tag names stay
the interface; the scalars tab still lists all of them). Entries are regular expressions over
tags. RL logs at steps >= 1 and validation at 0 (before RL); the warm start logs at steps <= 0
under warm_start/ only, so no RL chart stretches back over it."""


class MetricsLogger:
    """Writes scalars under <run_dir>/tb/ and remembers them per tag for the final summary."""

    def __init__(self, run_dir: Path, purge_step: int | None = None):
        """`purge_step`: hide events an earlier run in this folder logged at steps >= it."""
        from torch.utils.tensorboard import SummaryWriter

        self.tb_dir = run_dir / "tb"
        self.writer = SummaryWriter(log_dir=str(self.tb_dir), purge_step=purge_step)
        self.writer.add_custom_scalars(DASHBOARD)
        self.history: dict[str, list[tuple[int, float]]] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            value = float(value)
            self.writer.add_scalar(tag, value, step)
            self.history.setdefault(tag, []).append((step, value))
        self.writer.flush()

    def series(self, tag: str) -> list[float]:
        return [v for _, v in self.history.get(tag, [])]

    def close(self) -> None:
        self.writer.close()


def first_last_mean(values: list[float], k: int = 5) -> tuple[float, float]:
    """Mean of the first k and of the last k values (nan when empty)."""
    if not values:
        return float("nan"), float("nan")
    return float(np.mean(values[:k])), float(np.mean(values[-k:]))


GENERATOR_TAGS = (
    "generator/queue_time_ms",
    "generator/time_to_first_token_ms",
    "generator/decode_time_ms",
    "generator/inflight_at_completion",
    "generator/prefix_hit_tokens",
    "generator/preemptions",
)
"""Per-completion engine metrics, reduced to mean/std/max per step."""


def rollout_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """Metrics of the rollouts that go into training this step."""
    rollouts = [r for g in groups for r in g.rollouts]
    valid = [r for r in rollouts if not r.status.is_error()]
    out: dict[str, float] = {}
    out.update(summarize("rollout/num_turns", [len(r.turns) for r in valid]))
    out.update(summarize("rollout/branches_per_rollout", [count_branches(r) for r in valid]))
    out.update(
        summarize(
            "rollout/output_tokens", [t.completion.num_tokens for r in valid for t in r.turns]
        )
    )
    names = sorted({name for r in valid for name in r.reward_breakdown})
    for name in names:  # each rubric function, weight 0 ones included (env metrics)
        values = [r.reward_breakdown[name] for r in valid if name in r.reward_breakdown]
        out.update(summarize(f"rollout_reward/{name}", values))
    for tag in GENERATOR_TAGS:
        values = [
            t.completion.metrics[tag] for r in valid for t in r.turns if tag in t.completion.metrics
        ]
        out.update(summarize(tag, values))
    return out


def validation_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """validation_reward/mean (errors count 0 here: a held-out score must not hide them),
    the mean of each rubric function as validation_reward/<name> (a solve rate apart from
    partial scores, say; errors count 0 too), per-turn score means and status fractions."""
    rewards = [0.0 if r.status.is_error() else r.reward for r in rollouts]
    out = {"validation_reward/mean": float(np.mean(rewards)) if rewards else float("nan")}
    names = sorted({name for r in rollouts for name in r.reward_breakdown})
    for name in names:
        values = [
            0.0 if r.status.is_error() else r.reward_breakdown.get(name, 0.0) for r in rollouts
        ]
        out[f"validation_reward/{name}"] = float(np.mean(values))
    turns = max((len(r.turns) for r in rollouts), default=0)
    for t in range(turns):
        scores = [
            r.turns[t].reward_signals.get("turn_score", 0.0) if t < len(r.turns) else 0.0
            for r in rollouts
        ]
        out[f"validation_reward/turn_{t + 1}"] = float(np.mean(scores))
    counts = Counter(r.status for r in rollouts)
    for status in RolloutStatus:
        if counts.get(status):
            out[f"validation/status/{status.value}"] = counts[status] / len(rollouts)
    return out


def batch_metrics(batch: CollectedBatch) -> dict[str, float]:
    """Metrics over every rollout sampled this step (kept, filtered or surplus)."""
    sampled, kept, surplus, rounds = batch.sampled(), batch.groups, batch.surplus, batch.rounds
    rollouts = [r for g in sampled for r in g.rollouts]
    valid = [r for r in rollouts if not r.status.is_error()]
    statuses = Counter(r.status for r in rollouts)
    metrics: dict[str, float] = {
        "rollout/num_groups_sampled": float(len(sampled)),
        "rollout/num_groups_kept": float(len(kept)),
        "rollout/num_groups_filtered": float(len(sampled) - len(kept) - len(surplus)),
        "rollout/num_groups_surplus": float(len(surplus)),
        "rollout/num_sampling_rounds": float(rounds),
        "rollout/num_rollouts": float(len(rollouts)),
        "rollout/num_error_rollouts": float(len(rollouts) - len(valid)),
        "rollout/scorer_raised": float(sum(r.scorer_error is not None for r in rollouts)),
    }
    for status in RolloutStatus:
        share = statuses.get(status, 0) / len(rollouts) if rollouts else 0.0
        metrics[f"rollout/status/{status.value}"] = float(share)
    if sampled:
        metrics["rollout_reward/zero_std_frac"] = float(
            sum(not group_has_signal(g) for g in sampled) / len(sampled)
        )
    if valid:
        rewards = np.array([r.reward for r in valid], dtype=np.float64)
        metrics["rollout_reward/mean"] = float(rewards.mean())
        metrics["rollout_reward/std"] = float(rewards.std())
    return metrics
