"""The staleness bound, checked where a step's batch is formed.

A token's staleness is how many policy versions separate the policy being updated from the
one that sampled it. A completion records the oldest and newest version among its tokens, so
a rollout's oldest token is the minimum over its turns; a group trains only if every rollout
in it is within `max_staleness` (a group is scored together, so it stays or goes whole).

    versions: generator v3 sampled a rollout; the trainer is about to update v4 -> v5
    staleness = 4 - 3 = 1   -> trains under max_staleness >= 1, dropped under 0
"""

from __future__ import annotations

import numpy as np

from torchtitan_rl.types import Rollout, RolloutGroup


def oldest_version(rollout: Rollout) -> int | None:
    """The version of the rollout's oldest token (None: it sampled nothing)."""
    return min((t.completion.policy_version_min for t in rollout.turns), default=None)


def split_stale(
    groups: list[RolloutGroup], *, version: int, max_staleness: int
) -> tuple[list[RolloutGroup], list[RolloutGroup]]:
    """(fresh, stale): a group is stale when any of its rollouts has a token more than
    `max_staleness` versions behind `version`, the policy the step updates."""
    floor = version - max_staleness
    fresh, stale = [], []
    for group in groups:
        versions = [oldest_version(r) for r in group.rollouts]
        old = any(v is not None and v < floor for v in versions)
        (stale if old else fresh).append(group)
    return fresh, stale


def staleness_metrics(groups: list[RolloutGroup], *, version: int) -> dict[str, float]:
    """rollout/staleness/mean|max over every generated token of the trained groups' valid
    rollouts, each counted at its completion's oldest version (exact unless a turn spans a
    weight pull; then an upper bound)."""
    behind, weights = [], []
    for group in groups:
        for rollout in group.rollouts:
            if rollout.status.is_error():
                continue
            for turn in rollout.turns:
                behind.append(version - turn.completion.policy_version_min)
                weights.append(turn.completion.num_tokens)
    if not sum(weights):
        return {}
    behind_a, weights_a = np.asarray(behind, np.float64), np.asarray(weights, np.float64)
    return {
        "rollout/staleness/mean": float((behind_a * weights_a).sum() / weights_a.sum()),
        "rollout/staleness/max": float(behind_a[weights_a > 0].max()),
    }
