"""The default staleness weight of asynchronous runs, against float64 hand values.

With rollout.max_staleness >= 1 and loss.old_logprobs = "recompute", pi_old is the trainer's
policy at the update, so a token generated 2 versions ago starts at PPO ratio 1 like a fresh
one; its staleness is in pi_old / mu. Without a [correction] the trainer weights each token by
w_t = min(pi_old / mu, 2) (corrections.trainer_correction), so for grpo with token_mean over
N tokens d loss / d logp_t = -w_t A_t r_t 1[not clipped] / N.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from torchtitan_rl.losses.corrections import (
    BEHAVIOUR_WEIGHT_CAP,
    CorrectionConfig,
    check_objective,
    trainer_correction,
)
from torchtitan_rl.losses.objective import microbatch_objective
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.reductions import results

F64 = torch.float64
# pi_old (recomputed at train time) and mu (the generator's, at the version that sampled):
# token 0 fresh (mu == pi_old), tokens 1-3 sampled 2 versions ago.
OLD = torch.tensor([-1.2, -0.7, -2.0, -0.4], dtype=F64)
LOG_C = torch.tensor([0.0, 0.3, 1.0, -0.5], dtype=F64)  # log pi_old - log mu
GEN = OLD - LOG_C
ADV = torch.tensor([0.8, 1.0, -1.0, 0.7], dtype=F64)
SEQ = torch.tensor([0, 1, 1, 2])


def coefficients(lp, *, loss=None, correction=None, max_staleness=2, gen=GEN):
    """-N d loss / d logp_t through the trainer's objective, and the step's metrics."""
    loss = loss or LossConfig()
    correction = trainer_correction(
        loss, correction or CorrectionConfig(), max_staleness=max_staleness
    )
    lp = lp.clone().requires_grad_()
    value, metrics = microbatch_objective(
        lp, OLD if loss.old_logprobs == "recompute" else None, gen, ADV, SEQ,
        loss=loss, correction=correction, num_global_tokens=4, num_global_sequences=3,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(value, lp)
    return -4 * grad, results(metrics)


def test_two_stale_token_is_weighted_by_truncated_pi_old_over_mu():
    got, metrics = coefficients(OLD)  # first update: pi_theta = pi_old, r = 1
    # w = [1, e^0.3, min(e^1, 2), e^-0.5]; coefficient w A
    expected = [0.8, 1.3498588075760032, -2.0, 0.6065306597126334 * 0.7]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)
    assert metrics["correction/truncated_frac"] == pytest.approx(1 / 4)


def test_weight_multiplies_the_ppo_ratio_at_a_later_update():
    lp = OLD + torch.tensor([0.0, 0.1, 0.0, 0.5], dtype=F64)  # token 3: r = e^0.5, clipped
    got, _ = coefficients(lp)
    expected = [0.8, math.exp(0.3) * 1.0 * math.exp(0.1), -2.0, 0.0]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)


def test_fresh_token_coefficient_is_unchanged():
    synchronous, _ = coefficients(OLD, max_staleness=0)
    asynchronous, _ = coefficients(OLD, max_staleness=1)
    assert asynchronous[0].item() == synchronous[0].item() == 0.8
    assert synchronous[1:].tolist() == ADV[1:].tolist()  # synchronous: no weight, -A


def test_a_correction_with_a_level_is_applied_once():
    wide = CorrectionConfig(level="token", action="truncate", ratio_max=10.0)
    got, _ = coefficients(OLD, correction=wide)
    torch.testing.assert_close(got, torch.exp(LOG_C) * ADV, rtol=1e-12, atol=0)
    assert trainer_correction(LossConfig(), wide, max_staleness=2) is wide
    # pure rejection is the user's choice of how pi_old / mu enters: weight 1 inside the band
    rejection = CorrectionConfig(level="token", action="mask", keep_weight=False, ratio_max=1.5)
    got, _ = coefficients(OLD, correction=rejection)
    torch.testing.assert_close(got, ADV * torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=F64))


def test_generator_mode_and_synchronous_runs_keep_their_correction():
    none = CorrectionConfig()
    assert trainer_correction(LossConfig(), none, max_staleness=0) is none
    generator = LossConfig(old_logprobs="generator")
    assert trainer_correction(generator, none, max_staleness=2) is none
    # generator mode: the ratio pi_theta / mu already carries the staleness, applied once
    got, _ = coefficients(OLD, loss=LossConfig(old_logprobs="generator", clip_high=10.0))
    torch.testing.assert_close(got, torch.exp(LOG_C) * ADV, rtol=1e-12, atol=0)


def test_default_weight_keeps_opsm_and_suits_every_loss():
    opsm = CorrectionConfig(opsm_delta=0.5)
    resolved = trainer_correction(LossConfig(), opsm, max_staleness=2)
    assert (resolved.level, resolved.action, resolved.opsm_delta) == ("token", "truncate", 0.5)
    assert (resolved.ratio_min, resolved.ratio_max) == (0.0, BEHAVIOUR_WEIGHT_CAP)
    for name in ("grpo", "dapo", "dr_grpo", "gspo", "cispo"):
        loss = LossConfig(name=name, clip_high=0.28)
        check_objective(loss, trainer_correction(loss, CorrectionConfig(), max_staleness=2))
    gspo = trainer_correction(LossConfig(name="gspo"), CorrectionConfig(), max_staleness=1)
    assert gspo.level == "geometric"


class _Mesh:
    """Stands in for a Monarch proc mesh: records what the trainer actor would be spawned with."""

    def spawn(self, name, actor, **kwargs):
        self.kwargs = kwargs


@pytest.mark.usefixtures("package_logger_restored")
@pytest.mark.parametrize(("staleness", "level"), [(2, "token"), (0, "none")])
def test_the_trainer_is_spawned_with_the_default_weight_of_an_asynchronous_run(
    tmp_path, caplog, staleness, level
):
    from torchtitan_rl.config import load_config
    from torchtitan_rl.controller.launcher import spawn_trainer

    overrides = [f"--rollout.max_staleness={staleness}", "--loss.old_logprobs=recompute"]
    config = load_config(None, [f"--job.output_dir={tmp_path}", *overrides])
    mesh = _Mesh()
    logging.getLogger("torchtitan_rl").propagate = True
    with caplog.at_level(logging.INFO, logger="torchtitan_rl.controller.launcher"):
        spawn_trainer(mesh, config, vocab_size=8, log_dir=str(tmp_path))
    correction = mesh.kwargs["correction"]
    assert (correction.level, correction.ratio_max) == (level, 2.0)
    assert config.correction.level == "none"  # the saved config stays what the user wrote
    said = "each token is weighted by min(pi_old / mu, 2) (TIS at level 'token')"
    assert (said in caplog.text) == (staleness > 0)
