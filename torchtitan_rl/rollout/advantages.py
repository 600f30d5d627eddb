"""Group-relative advantages (GRPO family).

Within a group of sibling rollouts of one prompt, each valid rollout's advantage is its
reward minus the group mean (optionally divided by the group std). Error rollouts are
excluded from the statistics and get advantage 0; they are never trained on.

Example: rewards [1, 0, ERROR, 0.5] -> mean 0.5 -> advantages [0.5, -0.5, 0, 0].
With `positive_weight = 0.1` (W-REINFORCE's lambda): [0.05, -0.5, 0, 0].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchtitan_rl.checks import check_range
from torchtitan_rl.types import Rollout, RolloutGroup


@dataclass(kw_only=True, slots=True)
class AdvantageConfig:
    """TOML section [advantage]."""

    normalize_std: bool = False
    """Divide (reward - group mean) by the group's population std (+ eps). False is Dr. GRPO."""
    positive_weight: float = 1.0
    """Multiplies the positive advantages (rollouts better than their group's mean), after
    any std division. Below 1 (W-REINFORCE uses 0.1) pushing down wrong samples outweighs
    sharpening onto right ones, which holds the policy's entropy up; 0 trains on wrong samples
    only. 1 is plain GRPO."""

    def validate(self) -> None:
        check_range("advantage.positive_weight", self.positive_weight, ge=0)


def valid_rollouts(group: RolloutGroup) -> list[Rollout]:
    """The rollouts that count for statistics and training (status not an error)."""
    return [r for r in group.rollouts if not r.status.is_error()]


def group_has_signal(group: RolloutGroup) -> bool:
    """True when at least two valid rollouts have different rewards (nonzero spread)."""
    rewards = [r.reward for r in valid_rollouts(group)]
    return len(rewards) >= 2 and max(rewards) > min(rewards)


def compute_advantages(group: RolloutGroup, config: AdvantageConfig, *, eps: float = 1e-6) -> None:
    """Set `rollout.advantage` in place on every rollout of the group, as `config` says."""
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    valid = valid_rollouts(group)
    for rollout in group.rollouts:
        rollout.advantage = 0.0
    if not valid:
        return
    rewards = np.array([r.reward for r in valid], dtype=np.float64)
    assert np.all(np.isfinite(rewards)), "non-finite reward on a non-error rollout"
    centered = rewards - rewards.mean()
    if config.normalize_std:
        centered = centered / (rewards.std() + eps)
    centered = np.where(centered > 0, centered * config.positive_weight, centered)
    for rollout, advantage in zip(valid, centered):
        rollout.advantage = float(advantage)
