"""Per-step metrics computed from rollout records (the controller logs them)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from torchtitan_rl.metrics import summarize
from torchtitan_rl.rollout.episodes import rollout_to_episodes
from torchtitan_rl.types import Rollout, RolloutGroup, RolloutStatus

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
    out.update(
        summarize("rollout/branches_per_rollout", [len(rollout_to_episodes(r)) for r in valid])
    )
    out.update(
        summarize(
            "rollout/output_tokens", [t.completion.num_tokens for r in valid for t in r.turns]
        )
    )
    for tag in GENERATOR_TAGS:
        values = [
            t.completion.metrics[tag] for r in valid for t in r.turns if tag in t.completion.metrics
        ]
        out.update(summarize(tag, values))
    return out


def validation_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """validation_reward/mean (errors count 0 here: a held-out score must not hide them),
    per-turn score means and status fractions."""
    rewards = [0.0 if r.status.is_error() else r.reward for r in rollouts]
    out = {"validation_reward/mean": float(np.mean(rewards)) if rewards else float("nan")}
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
