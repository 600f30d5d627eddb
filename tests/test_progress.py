"""The RL progress bar says whether a run is working: reward, validation once there is one,
the gradient norm; not a loss that sits near 0 either way."""

from torchtitan_rl.controller.progress import rl_postfix

STEP = {
    "rollout_reward/mean": 0.4321,
    "loss/mean": 1.2e-5,
    "trainer/grad_norm": 0.0123,
    "perf/tokens_per_second": 1234.5,
}


def test_the_bar_shows_reward_validation_and_grad_norm_not_the_loss():
    assert rl_postfix(STEP, 0.5) == {
        "reward": "0.432", "val": "0.500", "gnorm": "0.0123", "tok_s": "1234",
    }  # fmt: skip


def test_no_validation_and_an_untrained_step_show_no_nan():
    postfix = rl_postfix({"perf/tokens_per_second": 0.0}, float("nan"))
    assert postfix == {"reward": "-", "gnorm": "-", "tok_s": "0"}
    assert "nan" not in str(postfix)
