import numpy as np
import pytest

from torchtitan_rl.rollout.advantages import (
    AdvantageConfig,
    compute_advantages,
    group_has_signal,
)
from torchtitan_rl.types import Rollout, RolloutGroup, RolloutStatus


def make_group(rewards, errors=()):
    rollouts = [
        Rollout(
            group_id=0,
            rollout_id=i,
            session_id=f"s{i}",
            sample={},
            reward=r,
            status=RolloutStatus.ERROR_ENV if i in errors else RolloutStatus.COMPLETED,
        )
        for i, r in enumerate(rewards)
    ]
    return RolloutGroup(group_id=0, rollouts=rollouts)


def test_advantage_is_reward_minus_mean_of_valid_rollouts_and_zero_for_errors():
    group = make_group([1.0, 0.0, 5.0, 0.5], errors={2})
    group.rollouts[2].advantage = 9.0  # stale value must be cleared
    compute_advantages(group, AdvantageConfig(normalize_std=False))
    assert [r.advantage for r in group.rollouts] == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_normalize_std_matches_float64_reference():
    rewards = [0.3, 1.7, -0.4, 2.2, 0.9]
    group = make_group(rewards)
    compute_advantages(group, AdvantageConfig(normalize_std=True), eps=1e-6)
    ref = np.array(rewards, dtype=np.float64)
    expected = (ref - ref.mean()) / (ref.std() + 1e-6)
    np.testing.assert_allclose([r.advantage for r in group.rollouts], expected, rtol=1e-12)


def test_all_equal_rewards_give_zero_advantage_even_when_normalized():
    group = make_group([2.0, 2.0, 2.0])
    compute_advantages(group, AdvantageConfig(normalize_std=True))
    assert [r.advantage for r in group.rollouts] == [0.0, 0.0, 0.0]


def test_all_error_group_gets_zero_advantages():
    group = make_group([1.0, 2.0], errors={0, 1})
    compute_advantages(group, AdvantageConfig(normalize_std=True))
    assert [r.advantage for r in group.rollouts] == [0.0, 0.0]


def test_group_has_signal_needs_two_valid_rollouts_with_different_rewards():
    assert group_has_signal(make_group([0.0, 1.0]))
    assert not group_has_signal(make_group([1.0, 1.0, 1.0]))
    assert not group_has_signal(make_group([0.0, 1.0], errors={1}))
    assert not group_has_signal(make_group([]))


def test_nonpositive_eps_is_rejected():
    with pytest.raises(ValueError, match="eps"):
        compute_advantages(make_group([0.0, 1.0]), AdvantageConfig(normalize_std=True), eps=0.0)


@pytest.mark.parametrize("normalize_std", [False, True])
@pytest.mark.parametrize("weight", [0.0, 0.1, 1.0, 2.5])
def test_positive_weight_scales_only_positive_advantages_float64(normalize_std, weight):
    rewards = [1.0, 0.0, 0.0, 1.0, 0.25, 7.0]
    group = make_group(rewards, errors={5})
    compute_advantages(group, AdvantageConfig(normalize_std=normalize_std, positive_weight=weight))
    ref = np.array(rewards[:5], dtype=np.float64)
    centered = ref - ref.mean()
    if normalize_std:
        centered = centered / (ref.std() + 1e-6)
    expected = [a * weight if a > 0 else a for a in centered] + [0.0]
    np.testing.assert_allclose([r.advantage for r in group.rollouts], expected, rtol=1e-12)
    assert group.rollouts[1].advantage < 0  # wrong samples keep their full push down


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_positive_weight_out_of_range_names_the_key(bad):
    with pytest.raises(ValueError, match=r"advantage.positive_weight must be finite and >= 0"):
        AdvantageConfig(positive_weight=bad).validate()
