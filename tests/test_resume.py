"""Exact resume through Monarch: 6 steps straight == stop after 3, then resume to 6."""

import asyncio
from pathlib import Path

import pytest
from fakes import FakeEnvironment, FakeRenderer, ScriptedEnv, ScriptedGenerate, done

from torchtitan_rl.config import load_config
from torchtitan_rl.controller.checkpoints import CheckpointStore, ControllerState
from torchtitan_rl.controller.loop import Controller
from torchtitan_rl.controller.metrics import batch_metrics
from torchtitan_rl.controller.summary import SUMMARY_TAGS
from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.rollout.rollout_config import RolloutConfig
from torchtitan_rl.rollout.rollouter import Rollouter

ROOT = Path(__file__).resolve().parents[1]
COMPARED = (
    "rollout_reward/mean",
    "validation_reward/mean",
    "loss/mean",
    "trainer/policy_version",
    "trainer/lr",
    "rollout/output_tokens/mean",
    "trainer/logprob_diff/mean",
)


def tiny_config(tmp_path, run_name, *overrides):
    return load_config(
        ROOT / "train_configs" / "alphabet_sort_tiny.toml",
        [
            f"--job.output_dir={tmp_path}",
            f"--job.run_name={run_name}",
            "--training.steps=6",
            "--training.lr=0.01",
            "--warm_start.steps=2",
            "--warm_start.batch_size=4",
            "--rollout.group_size=4",
            "--rollout.prompts_per_step=2",
            "--rollout.max_tokens=12",
            # a 2-step warm start earns no reward: no group would survive the filter, and
            # the entropy bonus gives every step a gradient that depends on the samples
            "--rollout.filter_zero_std_groups=false",
            "--loss.entropy_coef=0.01",
            "--env.args.reward_power=1.0",
            "--validation.interval=3",
            "--validation.num_samples=4",
            "--validation.max_tokens=8",
            "--generator.max_num_seqs=16",
            "--checkpoint.interval=2",
            *overrides,
        ],
    )


def run(config) -> dict[str, dict[int, float]]:
    controller = Controller(config, use_tqdm=False)

    async def go():
        try:
            await controller.run()
        finally:
            await controller.close()

    asyncio.run(go())
    history = controller.metrics.history
    return {tag: {s: v for s, v in history.get(tag, []) if s >= 1} for tag in COMPARED}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [[], ["--lora.rank=4"]], ids=["full", "lora"])
def test_stop_and_resume_matches_a_straight_run(tmp_path, lora):
    """With [lora] the warm start trains the random base (warm_start.params "auto"): the
    checkpoint holds that base, and the resumed generator must get it before adapters."""
    straight = run(tiny_config(tmp_path, "straight", *lora))
    first = run(
        tiny_config(
            tmp_path, "resumed", "--training.stop_after=3", "--checkpoint.export_hf=true", *lora
        )
    )
    store = CheckpointStore(tmp_path / "resumed", keep_latest=2)
    assert [s for s, _ in store.complete()] == [2, 3]
    assert (store.latest() / "hf" / "model.safetensors").is_file()
    second = run(tiny_config(tmp_path, "resumed", *lora))

    for tag in COMPARED:
        steps = [3, 6] if tag.startswith("validation") else list(range(1, 7))
        assert sorted(first[tag]) == [s for s in steps if s <= 3], tag
        if tag not in SUMMARY_TAGS:  # summary series come back from the checkpoint
            assert sorted(second[tag]) == [s for s in steps if s > 3], tag  # none ran twice
        resumed = {**first[tag], **second[tag]}
        for step in steps:
            assert resumed[step] == pytest.approx(straight[tag][step], abs=1e-6), (tag, step)
    # the sampled text itself: best and worst rollout of every group, every step
    for step in range(1, 7):
        name = f"rollouts/step_{step}.jsonl"
        assert (tmp_path / "resumed" / name).read_text() == (
            tmp_path / "straight" / name
        ).read_text()
    assert [s for s, _ in store.complete()] == [4, 6]
    assert (tmp_path / "resumed" / "hf" / "config.json").is_file()


def _rollouter():
    env_config = EnvConfig(max_turns=1, max_rollout_tokens=1000, step_timeout_s=5.0)
    # a reward that depends on the sampled text, so some groups tie and get refilled
    environment = FakeEnvironment(
        lambda sample: ScriptedEnv([done()]),
        lambda r: float(r.turns[0].assistant_text[-1] in "13579"),
        config=env_config,
    )
    config = RolloutConfig(group_size=3, prompts_per_step=2, max_sampling_rounds=3)
    return Rollouter(environment, FakeRenderer(), env_config, config, seed=7)


def _seeded_generate():  # the "sample" is a function of the request seed, as in the engine
    return ScriptedGenerate(lambda call: f"answer {call.sampling.seed % 1000}")


def _steps(rollouter, steps, next_sample):
    out = []
    for step in steps:
        batch = asyncio.run(rollouter.collect_batch(step, next_sample, _seeded_generate()))
        groups, next_sample, metrics = batch.groups, batch.next_index, batch_metrics(batch)
        texts = [[r.turns[0].assistant_text for r in g.rollouts] for g in groups]
        samples = [g.rollouts[0].sample["index"] for g in groups]
        out.append((samples, texts, metrics["rollout/num_sampling_rounds"]))
    return out, next_sample


def test_step_and_next_sample_are_all_the_rollouts_need_to_continue():
    straight, _ = _steps(_rollouter(), range(1, 5), 0)
    first, next_sample = _steps(_rollouter(), range(1, 3), 0)
    state = ControllerState.capture(
        step=2, next_sample=next_sample, last_validation=0.0, history={}
    )
    restored = ControllerState.from_json(state.to_json())
    second, _ = _steps(_rollouter(), range(restored.step + 1, 5), restored.next_sample)
    assert first + second == straight
    assert any(rounds > 1 for _, _, rounds in straight), "refill rounds were exercised"


def test_a_fresh_start_deletes_what_an_earlier_run_without_a_checkpoint_left(tmp_path):
    from torchtitan_rl.controller.resume import clear_earlier_run

    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1").write_text("old curves")
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "step_1.jsonl").write_text("{}")
    (tmp_path / "errors.log").write_text("step 1: ...")
    (tmp_path / "hf").mkdir()  # the earlier policy is not in the way: kept until overwritten
    assert clear_earlier_run(tmp_path) == ["tb/", "rollouts/", "errors.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert clear_earlier_run(tmp_path) == []  # nothing to say the second time
