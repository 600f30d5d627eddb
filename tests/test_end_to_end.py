"""The whole loop through Monarch: 2 trainer procs (FSDP over gloo) + 1 generator proc."""

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from driver import drive
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from torchtitan_rl.config import load_config
from torchtitan_rl.controller.loop import Controller
from torchtitan_rl.rollout.batcher import BatcherConfig, pack_batch
from torchtitan_rl.types import Episode, SamplingParams
from torchtitan_rl.weight_sync.packing import unpack_weights

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_TAGS = [
    "rollout_reward/mean",
    "rollout_reward/std",
    "loss/mean",
    "trainer/grad_norm",
    "trainer/lr",
    "trainer/policy_version",
    "trainer/logprob_diff/max",
    "perf/step_seconds",
    "perf/tokens_per_second",
    "validation_reward/mean",
]


def _config(tmp_path, *extra):
    return load_config(
        ROOT / "train_configs" / "alphabet_sort_tiny.toml",
        [
            f"--job.output_dir={tmp_path}",
            "--job.run_name=e2e",
            "--training.steps=2",
            "--training.lr=0.01",
            "--warm_start.steps=2",
            "--warm_start.batch_size=4",
            "--rollout.group_size=4",
            "--rollout.prompts_per_step=2",
            "--rollout.max_tokens=16",
            "--rollout.filter_zero_std_groups=false",
            # a barely trained policy often scores 0 everywhere (no advantage signal); the
            # entropy bonus guarantees the RL step itself has a gradient to apply
            "--loss.entropy_coef=0.01",
            "--env.args.reward_power=1.0",
            "--validation.num_samples=4",
            "--validation.max_tokens=16",
            "--validation.interval=1",
            "--generator.max_num_seqs=16",
            "--generator.num_replicas=2",  # two generator meshes behind the router
            "--training.minibatches=1",  # one optimizer step per RL step
            "--loss.old_logprobs=generator",  # fp32 both sides: mu is pi_old bit for bit
            *extra,
        ],
    )


async def _weights(controller):
    packed = [p for p in (await controller.trainer.publish_weights.call()).values() if p]
    return packed[0].version, {k: v.clone() for k, v in unpack_weights(packed[0]).items()}


async def _scenario(config):
    controller = Controller(config, use_tqdm=False)
    try:
        await controller.start()
        await controller.warm_start()
        v0, w0 = await _weights(controller)
        await controller.validate(0)
        for step in (1, 2):
            await controller.rl_step(step)
        await controller.validate(2)
        v1, w1 = await _weights(controller)
        # the generator holds the trainer's latest weights: compare log-probs of its sample
        prompt = controller.renderer.render_prompt(
            [{"role": "user", "content": "Sort these names: Ann Lee, Bo Yu"}]
        )
        completion = await controller.fleet.generate_fn(
            prompt, request_id="check", sampling=SamplingParams(max_tokens=12, seed=5)
        )
        ids = np.concatenate([prompt, completion.token_ids_N]).astype(np.int32)
        mask = np.zeros(len(ids), bool)
        mask[len(prompt) :] = True
        logprobs = np.zeros(len(ids), np.float32)
        logprobs[len(prompt) :] = completion.logprobs_N
        episode = Episode(
            token_ids_L=ids, loss_mask_L=mask, logprobs_L=logprobs, advantages_L=logprobs * 0
        )
        batches, _ = pack_batch(
            [episode],
            config=BatcherConfig(seq_len=128, rows_per_microbatch=1),
            num_ranks=2,
            pad_id=0,
        )
        trainer_lp = (await controller.trainer.logprobs.call(batches[0][0], 1.0)).values()
        generator_versions = [await g.policy_version.call_one() for g in controller.fleet.actors]
        routed = list(controller.fleet.router.routed)
        sessions_left = dict(controller.fleet.router.sessions)
        return dict(
            v0=v0,
            v1=v1,
            w0=w0,
            w1=w1,
            completion=completion,
            trainer_lp=np.asarray(next(iter(trainer_lp))),
            generator_versions=generator_versions,
            routed=routed,
            sessions_left=sessions_left,
            tb_dir=controller.metrics.tb_dir,
        )
    finally:
        await controller.close()


@pytest.mark.slow
def test_two_rl_steps_through_monarch(tmp_path):
    torch.manual_seed(0)
    r = asyncio.run(_scenario(_config(tmp_path)))
    assert r["v0"] == 2 and r["v1"] == 4, "two warm-start and two RL optimizer steps"
    assert r["generator_versions"] == [r["v1"], r["v1"]], "every replica has the latest weights"
    assert min(r["routed"]) > 0, "the router used both replicas"
    assert r["sessions_left"] == {}, "every rollout's session ended with it"
    changed = [k for k in r["w0"] if not torch.equal(r["w0"][k], r["w1"][k])]
    assert len(changed) == len(r["w0"]), "RL steps change every trainer tensor"
    np.testing.assert_allclose(r["trainer_lp"], r["completion"].logprobs_N, atol=1e-4, rtol=0)
    events = EventAccumulator(str(r["tb_dir"]))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert not [t for t in REQUIRED_TAGS if t not in tags]
    versions = [e.value for e in events.Scalars("trainer/policy_version")]
    assert versions[-1] == 4
    assert (r["tb_dir"].parent / "config.toml").is_file()


@pytest.mark.slow
def test_bf16_generator_mismatch_is_measured_and_corrected(tmp_path):
    """A bfloat16 generator and an fp32 trainer disagree for real: three RL steps with pi_old
    recomputed, token-level TIS and a KL penalty write the mismatch, correction and KL
    curves, and KL is positive once the policy has moved off the reference."""
    config = _config(
        tmp_path,
        "--training.steps=3",
        "--generator.dtype=bfloat16",
        "--generator.num_replicas=1",
        "--loss.old_logprobs=recompute",
        "--correction.level=token",
        "--correction.action=truncate",
        "--loss.kl_coef=0.05",
        "--validation.interval=0",
    )

    steps = drive(config, steps=3).steps
    assert all(m["trainer/logprob_diff/max"] > 0 for m in steps)
    assert steps[0]["loss/kl"] == 0 and steps[1]["loss/kl"] > 0 and steps[2]["loss/kl"] > 0
    assert [m["trainer/policy_version"] for m in steps] == [3, 4, 5]
    events = EventAccumulator(str(tmp_path / "e2e" / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    wanted = {
        "correction/ratio_mean",
        "correction/ratio_min",
        "correction/ratio_max",
        "correction/truncated_frac",
        "loss/kl",
        "trainer/logprob_diff/max",
    }
    assert wanted <= tags, wanted - tags
