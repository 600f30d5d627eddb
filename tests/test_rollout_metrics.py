"""Rollout metrics: every rubric function's value reaches TensorBoard, weight 0 ones too."""

from torchtitan_rl.controller.metrics import rollout_metrics, validation_metrics
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


def test_validation_reports_each_rubric_function_with_errors_counted_as_zero():
    rollouts = [
        _rollout(0, {"score": 1.0, "solved": 1.0}),
        _rollout(1, {"score": 0.1, "solved": 0.0}),
        _rollout(2, {"score": 1.0, "solved": 1.0}, RolloutStatus.ERROR_ENV),
        _rollout(3, {}, RolloutStatus.ERROR_REWARD),
    ]
    for r, reward in zip(rollouts, (1.0, 0.1, 1.0, 0.0)):
        r.reward = reward
    out = validation_metrics(rollouts)
    assert out["validation_reward/mean"] == (1.0 + 0.1) / 4
    assert out["validation_reward/solved"] == 1 / 4
    assert abs(out["validation_reward/score"] - 1.1 / 4) < 1e-12


def test_generated_tokens_count_every_group_sampled_filtered_ones_too():
    from types import SimpleNamespace

    from torchtitan_rl.controller.report import StepReport
    from torchtitan_rl.rollout.rollouter import CollectedBatch

    def group(gid: int, tokens: int) -> RolloutGroup:
        turn = SimpleNamespace(completion=SimpleNamespace(num_tokens=tokens))
        rollout = Rollout(group_id=gid, rollout_id=0, session_id=str(gid), sample={})
        rollout.turns = [turn, turn]
        return RolloutGroup(group_id=gid, rollouts=[rollout])

    batch = CollectedBatch(
        groups=[group(0, 3)], next_index=2, rounds=2, filtered=[group(1, 5)], surplus=[]
    )
    report = StepReport(
        step=1, batch=batch, train={}, version=0, generate_seconds=2.0,
        trainer_wait_seconds=0.0, train_seconds=0.0, sync_seconds=0.0,
        generator_wait_seconds=0.0, step_seconds=1.0, generators={},
    )  # fmt: skip
    assert report.generated_tokens() == 2 * 3 + 2 * 5  # the filtered group's 10 too
