"""TrainerCore off-policy behaviour: pi_old recompute, the KL reference, metrics that do not
depend on how a step is cut into microbatches, and skipped steps."""

import math

import numpy as np
import pytest
import torch
from fakes import tiny_core

from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.rollout.batcher import BatcherConfig, pack_batch
from torchtitan_rl.training.trainer_config import TrainingConfig
from torchtitan_rl.types import Episode

VOCAB = 96
SEQ_LEN = 64


def _core(*, loss=None, correction=None, **training):
    return tiny_core(loss=loss, correction=correction, **training)


def _episodes(seed, n=4, length=60):
    """n episodes of `length` tokens: one per row of SEQ_LEN slots, so a batch of n rows
    splits into n / rows_per_microbatch microbatches."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        mask = np.zeros(length, bool)
        mask[length // 3 :] = True
        out.append(
            Episode(
                token_ids_L=rng.integers(0, VOCAB, length).astype(np.int32),
                loss_mask_L=mask,
                logprobs_L=np.zeros(length, np.float32),
                advantages_L=np.where(mask, rng.normal(), 0).astype(np.float32),
                rollout_id=i,
            )
        )
    return out


def _batch(episodes, rows_per_microbatch=2):
    config = BatcherConfig(seq_len=SEQ_LEN, rows_per_microbatch=rows_per_microbatch)
    return pack_batch(episodes, config=config, num_ranks=1, pad_id=0)[0][0]


def _with_generator_logprobs(core, episodes, noise=0.3, seed=0):
    """Episodes whose generator log-probs are the trainer's own plus a known mismatch."""
    rng = np.random.default_rng(seed)
    for ep in episodes:
        mb = _batch([ep], 1)[0]
        own = core.logprobs(mb)
        ep.logprobs_L[1:][ep.loss_mask_L[1:]] = own + rng.normal(0, noise, own.shape)
    return episodes


def test_recompute_makes_the_first_update_on_policy_and_later_ones_stale():
    """pi_old recomputed before any update: the first update's PPO ratio is exactly 1 (no
    clipping) although mu differs; a second minibatch update sees its own staleness."""
    loss = LossConfig(old_logprobs="recompute")
    core = _core(loss=loss)
    one = core.train_step([_batch(_with_generator_logprobs(core, _episodes(0)))], 1.0)
    assert one["loss/ratio_mean"] == 1.0 and one["loss/clip_frac"] == 0.0
    assert one["loss/log_ratio/abs_max"] == 0.0
    assert one["trainer/logprob_diff/max"] > 0.5  # mu really differs from pi_old

    core = _core(loss=loss)
    episodes = _with_generator_logprobs(core, _episodes(0))
    two = core.train_step([_batch(episodes[:2]), _batch(episodes[2:])], 1.0)
    assert two["trainer/policy_version"] == 2
    assert two["loss/ratio_mean"] != 1.0  # the second update's pi_theta moved off pi_old
    assert 0 < two["loss/log_ratio/abs_mean"] <= two["loss/log_ratio/abs_max"]

    core = _core(loss=LossConfig(old_logprobs="generator"))
    gen = core.train_step([_batch(_with_generator_logprobs(core, _episodes(0)))], 1.0)
    assert gen["loss/ratio_mean"] != 1.0 and gen["loss/clip_frac"] > 0  # ratio is pi / mu


def test_kl_is_zero_before_the_first_update_and_positive_after():
    core = _core(loss=LossConfig(kl_coef=0.1, kl_estimator="k3"))
    first = core.train_step([_batch(_episodes(1))], 1.0)
    second = core.train_step([_batch(_episodes(2))], 1.0)
    assert first["loss/kl"] == 0.0
    assert second["loss/kl"] > 0


@pytest.mark.parametrize("kl_coef", [0.0, 10.0])
def test_kl_coef_changes_the_gradient(kl_coef):
    """A step after the policy moved: the KL term's gradient shows in the grad norm."""
    norms = []
    for coef in (0.0, kl_coef):
        core = _core(loss=LossConfig(kl_coef=coef))
        core.train_step([_batch(_episodes(3))], 1.0)
        norms.append(core.train_step([_batch(_episodes(4))], 1.0)["trainer/grad_norm"])
    assert (norms[0] == norms[1]) == (kl_coef == 0.0)


def test_every_metric_is_the_same_with_one_two_or_four_microbatches():
    loss = LossConfig(kl_coef=0.05, entropy_coef=0.01)
    correction = CorrectionConfig(level="token", action="truncate", ratio_max=1.5, opsm_delta=0.05)
    outs = []
    for rows_per_microbatch in (4, 2, 1):
        core = _core(loss=loss, correction=correction)
        episodes = _with_generator_logprobs(core, _episodes(5))
        core.train_step([_batch(episodes)], 1.0)  # move the policy: KL and staleness > 0
        batch = _batch(_with_generator_logprobs(core, _episodes(6), seed=1), rows_per_microbatch)
        assert len(batch) == 4 // rows_per_microbatch
        out = core.train_step([batch], 1.0)
        outs.append({k: v for k, v in out.items() if not k.startswith("perf/")})  # not timings
    assert set(outs[0]) == set(outs[1]) == set(outs[2])
    for key in ("correction/ratio_min", "correction/ratio_max", "loss/kl", "loss/policy",
                "loss/log_ratio/abs_max", "correction/log_ratio/abs_mean"):  # fmt: skip
        assert key in outs[0]
    # token level: |log w| is |pi_old - mu|, the mismatch trainer/logprob_diff measures
    for stat in ("mean", "max"):
        got = outs[0][f"correction/log_ratio/abs_{stat}"]
        assert got == pytest.approx(outs[0][f"trainer/logprob_diff/{stat}"], rel=1e-6)
    assert outs[0]["loss/kl"] > 0 and outs[0]["correction/truncated_frac"] > 0
    for out in outs[1:]:
        for key, value in outs[0].items():
            assert out[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_loss_policy_is_the_policy_part_of_the_loss():
    """Without KL or entropy the policy term is the whole loss, however many microbatches."""
    core = _core()
    out = core.train_step([_batch(_episodes(7), rows_per_microbatch=1)], 1.0)
    assert out["loss/policy"] == pytest.approx(out["loss/mean"], rel=1e-6)


def test_a_skipped_step_leaves_the_learning_rate_schedule_where_it_was():
    core = _core(warmup_steps=4)
    lr0 = core.scheduler.get_last_lr()[0]
    bad = _episodes(8)
    bad[0].advantages_L[bad[0].loss_mask_L] = math.inf  # non-finite loss and gradient
    out = core.train_step([_batch(bad)], 1.0)
    assert out["trainer/skipped_steps"] == 1 and out["trainer/lr"] == lr0
    out = core.train_step([_batch(_episodes(9))], 1.0)  # runs with the first step's lr
    assert out["trainer/skipped_steps"] == 1 and out["trainer/lr"] == lr0
    assert core.train_step([_batch(_episodes(10))], 1.0)["trainer/lr"] > lr0


def test_trainer_lr_is_the_learning_rate_the_update_used():
    """4 warmup steps at lr 1e-3: the first update runs at 2e-4 (what moved the weights)."""
    core = _core(lr=1e-3, warmup_steps=4)
    logged = [core.train_step([_batch(_episodes(30 + i))], 1.0)["trainer/lr"] for i in range(3)]
    assert logged == pytest.approx([2e-4, 4e-4, 6e-4], rel=1e-12)


def test_lr_decay_to_ends_the_run_at_that_fraction_of_lr_by_cosine():
    def used_lrs(core, n):  # the learning rate each update runs with
        lrs = []
        for i in range(n):
            lrs.append(core.optimizer.param_groups[0]["lr"])
            core.train_step([_batch(_episodes(20 + i))], 1.0)
        return lrs

    # warmup 1/2, then 1 -> 0.1 over the remaining 4 optimizer steps (cos 0, pi/3, 2pi/3, pi)
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 3)) for k in range(4)]
    expected = [1e-2 * f for f in [0.5, *cosine, 0.1]]  # a step past the end stays at 0.1
    decayed = _core(lr=1e-2, steps=5, warmup_steps=1, lr_decay_to=0.1)
    assert used_lrs(decayed, 6) == pytest.approx(expected, rel=1e-9)
    constant = _core(lr=1e-2, steps=5, warmup_steps=1)
    assert used_lrs(constant, 3) == pytest.approx([5e-3, 1e-2, 1e-2], rel=1e-9)
    with pytest.raises(ValueError, match=r"training.lr_decay_to must be in \[0, 1\], got 1.5"):
        TrainingConfig(lr_decay_to=1.5).validate()


def test_kl_reference_folder_is_the_reference(tmp_path):
    """loss.kl_reference: the reference holds that folder's weights (here the policy after
    one update), not the initial policy, and the end of a warm start leaves it alone."""
    from torchtitan_rl.models.hf_export import export_hf

    moved = _core()
    batch = _batch(_episodes(10))
    moved.train_step([batch], 1.0)
    want = moved.full_state_dict()
    folder = export_hf(want, moved.model.model_args, tmp_path / "ref")
    core = _core(loss=LossConfig(kl_coef=0.1, kl_reference=str(folder)))
    core.start_rl()
    reference = core.reference.model.state_dict()
    assert all(torch.equal(reference[k], want[k]) for k in want)
    initial = core.full_state_dict()
    assert not all(torch.equal(initial[k], want[k]) for k in want)
    assert core.train_step([batch], 1.0)["loss/kl"] > 1e-6  # policy != reference at once
