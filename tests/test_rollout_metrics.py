"""Rollout metrics: every rubric function's value reaches TensorBoard, weight 0 ones too."""

from torchtitan_rl.controller.metrics import rollout_metrics
from torchtitan_rl.types import Rollout, RolloutGroup, RolloutStatus


def _rollout(i: int, breakdown: dict, status=RolloutStatus.COMPLETED) -> Rollout:
    return Rollout(
        group_id=0, rollout_id=i, session_id=str(i), sample={}, status=status,
        reward_breakdown=breakdown,
    )  # fmt: skip


def test_each_rubric_function_is_summarized_over_valid_rollouts():
    rollouts = [
        _rollout(0, {"score": 1.0, "tool_calls": 2.0}),
        _rollout(1, {"score": 0.0, "tool_calls": 0.0}),
        _rollout(2, {}, RolloutStatus.ERROR_ENV),  # errors are not averaged in
    ]
    out = rollout_metrics([RolloutGroup(group_id=0, rollouts=rollouts)])
    assert out["rollout_reward/score/mean"] == 0.5
    assert out["rollout_reward/tool_calls/mean"] == 1.0
    assert out["rollout_reward/tool_calls/max"] == 2.0
