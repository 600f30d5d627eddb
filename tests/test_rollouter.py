import asyncio
import gc
import logging
import math

import pytest
from fakes import (
    FakeEnvironment,
    FakeRenderer,
    Hang,
    ScriptedEnv,
    ScriptedGenerate,
    always,
    done,
    reply,
)

from torchtitan_rl.controller.metrics import batch_metrics
from torchtitan_rl.envs.base import EnvConfig, SampleError
from torchtitan_rl.rollout.rollout_config import RolloutConfig
from torchtitan_rl.rollout.rollouter import (
    REWARD_BOUND,
    Rollouter,
    refill_size,
    request_seed,
)
from torchtitan_rl.types import RolloutStatus


def make_rollouter(
    make_env_fn, reward_fn, *, env=None, seed=0, environment=FakeEnvironment, **config
):
    env_config = env or EnvConfig(max_turns=4, max_rollout_tokens=1000, step_timeout_s=5.0)
    environment = environment(make_env_fn, reward_fn, config=env_config)
    rollout_config = RolloutConfig(**{"group_size": 4, "prompts_per_step": 2, **config})
    return Rollouter(environment, FakeRenderer(), env_config, rollout_config, seed=seed)


def by_rollout_id(rollout):
    return float(rollout.rollout_id)


def three_turn_env(sample):
    return ScriptedEnv([reply("two"), reply("three"), done()])


def test_three_turn_rollout_records_turns_messages_and_reward():
    rollouter = make_rollouter(three_turn_env, lambda r: len(r.turns) / 10)
    group = asyncio.run(
        rollouter.run_group_rollouts({"index": 0}, always("ok"), group_id=3, step=7)
    )
    assert [r.rollout_id for r in group.rollouts] == [0, 1, 2, 3]
    rollout = group.rollouts[2]
    assert rollout.status is RolloutStatus.COMPLETED
    assert rollout.session_id == "step=7/group=3/rollout=2"
    assert len(rollout.turns) == 3
    assert math.isclose(rollout.reward, 0.3) and rollout.reward_breakdown == {"reward": 0.3}
    assert [m["role"] for m in rollout.messages] == ["user", "assistant"] * 3
    assert [t.assistant_text for t in rollout.turns] == ["ok"] * 3


def test_request_ids_and_seeds_are_deterministic_whatever_the_finish_order():
    def run_once(jitter_s):
        rollouter = make_rollouter(three_turn_env, by_rollout_id, seed=11, group_size=3)
        generate = ScriptedGenerate(lambda call: "ok", jitter_s=jitter_s)
        asyncio.run(rollouter.run_group_rollouts({"index": 0}, generate, group_id=1, step=5))
        return {c.request_id: (c.session_id, c.sampling.seed) for c in generate.calls}

    in_order, shuffled = run_once(0.0), run_once(0.01)
    assert in_order == shuffled
    assert in_order["step=5/group=1/rollout=2/turn=1"] == (
        "step=5/group=1/rollout=2",
        request_seed(11, 5, 1, 2, 1),
    )
    seeds = [seed for _, seed in in_order.values()]
    assert len(set(seeds)) == len(seeds) == 9
    assert all(0 <= s < 2**63 for s in seeds)
    assert request_seed(12, 5, 1, 2, 1) != request_seed(11, 5, 1, 2, 1)


def test_sampling_params_come_from_config_and_max_tokens_is_capped_by_budget():
    env = EnvConfig(max_turns=1, max_rollout_tokens=30, step_timeout_s=5.0)
    rollouter = make_rollouter(
        lambda s: ScriptedEnv([done()]), by_rollout_id, env=env, temperature=0.7, max_tokens=64
    )
    generate = always("ok")
    asyncio.run(rollouter.run_group_rollouts({"index": 0}, generate, group_id=0, step=0))
    call = generate.calls[0]
    assert call.sampling.temperature == 0.7
    assert call.sampling.stop_token_ids == FakeRenderer.stop_token_ids
    assert call.sampling.max_tokens == 30 - len(call.prompt_ids)


def test_env_that_raises_is_error_env_and_collect_batch_returns_the_others():
    def make_env(sample):
        if sample["index"] == 1:
            return ScriptedEnv([ValueError("bad move")])
        return ScriptedEnv([done()])

    rollouter = make_rollouter(make_env, by_rollout_id, prompts_per_step=3)
    batch = asyncio.run(rollouter.collect_batch(0, 0, always("ok")))
    groups, next_index, metrics = batch.groups, batch.next_index, batch_metrics(batch)
    assert [g.rollouts[0].sample["index"] for g in groups] == [0, 2, 3]
    assert next_index == 5  # 3 prompts, then 1 / (2/3) -> 2 more to refill the error group
    assert metrics["rollout/status/error_env"] == 4 / metrics["rollout/num_rollouts"]
    assert metrics["rollout/num_groups_filtered"] == 1
    assert metrics["rollout/num_groups_surplus"] == 1
    assert all(r.status is RolloutStatus.COMPLETED for g in groups for r in g.rollouts)


def test_error_rollout_is_flagged_with_finite_reward():
    def make_env(sample):
        return ScriptedEnv([ValueError("bad move")])

    rollouter = make_rollouter(make_env, by_rollout_id)
    group = asyncio.run(
        rollouter.run_group_rollouts({"index": 0}, always("ok"), group_id=0, step=0)
    )
    for rollout in group.rollouts:
        assert rollout.status is RolloutStatus.ERROR_ENV
        assert "bad move" in rollout.error
        assert rollout.reward == 0.0 and rollout.reward_breakdown == {}
        assert len(rollout.turns) == 1  # the completion is kept for inspection


def test_generator_returning_none_is_error_generator():
    rollouter = make_rollouter(three_turn_env, by_rollout_id)
    generate = ScriptedGenerate(lambda call: None if call.request_id.endswith("turn=1") else "ok")
    group = asyncio.run(rollouter.run_group_rollouts({"index": 0}, generate, group_id=0, step=0))
    assert {r.status for r in group.rollouts} == {RolloutStatus.ERROR_GENERATOR}
    assert all(len(r.turns) == 1 for r in group.rollouts)


def test_slow_env_is_error_timeout():
    env = EnvConfig(max_turns=2, max_rollout_tokens=1000, step_timeout_s=0.05)
    rollouter = make_rollouter(lambda s: ScriptedEnv([Hang(10.0)]), by_rollout_id, env=env)
    group = asyncio.run(
        rollouter.run_group_rollouts({"index": 0}, always("ok"), group_id=0, step=0)
    )
    assert {r.status for r in group.rollouts} == {RolloutStatus.ERROR_TIMEOUT}


@pytest.mark.parametrize(
    "reward_fn, error",
    [
        (lambda r: 1 / 0, "ZeroDivisionError"),
        (lambda r: float("nan"), "non-finite reward nan from rubric function 'reward'"),
        (lambda r: -1e308, "reward -1e+308 from rubric function 'reward' is beyond REWARD_BOUND"),
    ],
)
def test_raising_nonfinite_or_huge_reward_is_error_reward(reward_fn, error):
    rollouter = make_rollouter(lambda s: ScriptedEnv([done()]), reward_fn)
    group = asyncio.run(
        rollouter.run_group_rollouts({"index": 0}, always("ok"), group_id=0, step=0)
    )
    for rollout in group.rollouts:
        assert rollout.status is RolloutStatus.ERROR_REWARD and error in rollout.error
        assert rollout.reward == 0.0


def test_a_huge_reward_leaves_the_reward_mean_finite():
    def reward(rollout):  # one rollout of each group scores 1e308, the others the bound
        return 1e308 if rollout.rollout_id == 0 else REWARD_BOUND * rollout.rollout_id / 3

    rollouter = make_rollouter(lambda s: ScriptedEnv([done()]), reward, prompts_per_step=1)
    metrics = batch_metrics(asyncio.run(rollouter.collect_batch(0, 0, always("ok"))))
    assert metrics["rollout/status/error_reward"] == 0.25
    assert metrics["rollout_reward/mean"] == pytest.approx(REWARD_BOUND * 2 / 3)


def test_zero_spread_groups_are_filtered_and_refilled():
    def reward(rollout):  # odd samples: every sibling scores the same
        return 1.0 if rollout.sample["index"] % 2 else float(rollout.rollout_id)

    rollouter = make_rollouter(lambda s: ScriptedEnv([done()]), reward, prompts_per_step=3)
    batch = asyncio.run(rollouter.collect_batch(2, 10, always("ok")))
    groups, next_index, metrics = batch.groups, batch.next_index, batch_metrics(batch)
    # round 1: 10, 11, 12 keeps 2 of 3; the refill samples ceil(1 / (2/3)) = 2: 13, 14
    assert [g.rollouts[0].sample["index"] for g in groups] == [10, 12, 14]
    assert next_index == 15
    assert metrics["rollout/num_groups_filtered"] == 2
    assert metrics["rollout/num_groups_surplus"] == 0
    assert metrics["rollout/num_sampling_rounds"] == 2
    assert len({g.group_id for g in groups}) == 3


def test_refill_round_samples_the_missing_groups_over_the_kept_share():
    def reward(rollout):  # samples 10 and 11 have no spread, every later one has
        return float(rollout.rollout_id) if rollout.sample["index"] >= 12 else 1.0

    rollouter = make_rollouter(lambda s: ScriptedEnv([done()]), reward, prompts_per_step=3)
    batch = asyncio.run(rollouter.collect_batch(0, 10, always("ok")))
    # round 1 keeps 1 of 3, so the refill samples 2 / (1/3) = 6 groups (13..18) and keeps
    # the first two; the other four had spread but the batch was full
    assert [g.rollouts[0].sample["index"] for g in batch.groups] == [12, 13, 14]
    assert batch.next_index == 19
    assert batch_metrics(batch)["rollout/num_sampling_rounds"] == 2
    assert batch_metrics(batch)["rollout/num_groups_filtered"] == 2
    assert batch_metrics(batch)["rollout/num_groups_surplus"] == 4
    assert [g.rollouts[0].sample["index"] for g in batch.filtered] == [10, 11]
    assert [g.rollouts[0].sample["index"] for g in batch.surplus] == [15, 16, 17, 18]


def test_refills_stop_after_max_sampling_rounds_even_with_budget_left(caplog):
    def reward(rollout):  # only samples 0..6 have spread: the eighth group never comes
        return float(rollout.rollout_id) if rollout.sample["index"] < 7 else 1.0

    rollouter = make_rollouter(
        lambda s: ScriptedEnv([done()]), reward, prompts_per_step=8, max_sampling_rounds=2
    )
    with caplog.at_level(logging.WARNING):
        batch = asyncio.run(rollouter.collect_batch(0, 0, always("ok")))
    # rounds of 8, ceil(1 * 8 / 7) = 2, then ceil(1 * 10 / 7) = 2: 12 of the 24-group budget
    assert batch_metrics(batch)["rollout/num_sampling_rounds"] == 3
    assert batch.next_index == 12 and len(batch.groups) == 7
    assert "after 2 refill rounds (rollout.max_sampling_rounds=2)" in caplog.text


@pytest.mark.parametrize(
    ("need", "sampled", "kept", "size"),
    [
        (8, 0, 0, 8),
        (5, 8, 3, 14),
        (1, 3, 2, 2),
        (2, 2, 0, 8),
        (2, 10, 1, 8),
        (3, 4, 4, 3),
        (11, 15, 11, 15),
    ],
)
def test_refill_size(need, sampled, kept, size):
    assert refill_size(need, sampled, kept) == size


def test_collect_batch_warns_and_returns_what_it_has_after_max_rounds(caplog):
    rollouter = make_rollouter(
        lambda s: ScriptedEnv([done()]), lambda r: 1.0, prompts_per_step=2, max_sampling_rounds=1
    )
    with caplog.at_level(logging.WARNING):
        batch = asyncio.run(rollouter.collect_batch(0, 0, always("ok")))
        groups, next_index, metrics = batch.groups, batch.next_index, batch_metrics(batch)
    assert groups == [] and next_index == 4
    assert metrics["rollout/num_sampling_rounds"] == 2
    assert "only 0 of 2 groups" in caplog.text
    assert "after 1 refill rounds (rollout.max_sampling_rounds=1)" in caplog.text
    # 2 groups, then 4x the 2 missing capped by the budget of (1 + 1) * 2; none with spread
    assert len(batch.filtered) == 4


def test_a_step_whose_rollouts_all_errored_is_not_called_short_of_reward_spread(caplog):
    rollouter = make_rollouter(
        lambda s: ScriptedEnv([done()]), by_rollout_id, prompts_per_step=2, max_sampling_rounds=1
    )
    with caplog.at_level(logging.WARNING):
        batch = asyncio.run(rollouter.collect_batch(0, 0, ScriptedGenerate(lambda call: None)))
    assert batch.groups == [] and len(batch.filtered) == 4
    assert "have reward spread" not in caplog.text  # the errors are what to fix


def test_unfiltered_collect_batch_keeps_zero_spread_groups():
    rollouter = make_rollouter(
        lambda s: ScriptedEnv([done()]), lambda r: 1.0, filter_zero_std_groups=False
    )
    batch = asyncio.run(rollouter.collect_batch(0, 0, always("ok")))
    groups, next_index, _ = batch.groups, batch.next_index, batch_metrics(batch)
    assert len(groups) == 2 and next_index == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("group_size", 0), ("prompts_per_step", 0), ("max_sampling_rounds", -1), ("top_p", 0.0)],
)
def test_rollout_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"rollout.{field}"):
        RolloutConfig(**{field: value}).validate()


def test_first_prompt_over_token_budget_is_a_config_error_naming_the_field():
    env = EnvConfig(max_turns=1, max_rollout_tokens=5, step_timeout_s=5.0)
    rollouter = make_rollouter(lambda s: ScriptedEnv([done()]), by_rollout_id, env=env)
    with pytest.raises(ValueError, match="env.max_rollout_tokens"):
        asyncio.run(rollouter.run_group_rollouts({"index": 0}, always("ok"), group_id=0, step=0))


@pytest.mark.parametrize(
    "mistake, error",
    [
        (lambda: ScriptedEnv([None]), "ScriptedEnv.step (turn 0) returned None"),
        (lambda: ScriptedEnv([done()], first="\ud800"), "ScriptedEnv.init: message 0 content"),
    ],
)
def test_an_env_mistake_errors_its_rollouts_and_the_batch_goes_on(mistake, error):
    def make_env(sample):
        return mistake() if sample["index"] == 1 else ScriptedEnv([done()])

    rollouter = make_rollouter(make_env, by_rollout_id, prompts_per_step=3)
    batch = asyncio.run(rollouter.collect_batch(0, 0, always("ok")))
    assert [g.rollouts[0].sample["index"] for g in batch.groups] == [0, 2, 3]
    errored = [r for g in batch.filtered for r in g.rollouts]
    assert {r.status for r in errored} == {RolloutStatus.ERROR_ENV}
    assert all(r.error.startswith(error) for r in errored)


class ShortDataset(FakeEnvironment):
    def train_sample(self, index):
        if index >= 4:
            raise IndexError(f"dataset exhausted at {index}")
        return super().train_sample(index)


def test_a_train_sample_that_raises_names_env_method_and_index_and_leaves_no_coroutine(recwarn):
    rollouter = make_rollouter(
        lambda s: ScriptedEnv([done()]), by_rollout_id, environment=ShortDataset, prompts_per_step=3
    )
    with pytest.raises(SampleError) as info:
        asyncio.run(rollouter.collect_batch(0, 3, always("ok")))
    assert (
        str(info.value) == "ShortDataset.train_sample(4) raised IndexError: dataset exhausted at 4"
    )
    del info
    gc.collect()
    assert [str(w.message) for w in recwarn if "never awaited" in str(w.message)] == []


def test_the_refill_warning_is_said_once_and_again_only_when_a_step_keeps_fewer(caplog):
    spread_below = {0: 7, 1: 7, 2: 5, 3: 7}  # step -> samples below this index have spread

    def reward(rollout):
        index, step = rollout.sample["index"], rollout.sample["index"] // 100
        return float(rollout.rollout_id) if index % 100 < spread_below[step] else 1.0

    rollouter = make_rollouter(
        lambda s: ScriptedEnv([done()]), reward, prompts_per_step=8, max_sampling_rounds=0
    )
    with caplog.at_level(logging.WARNING):
        for step in range(4):
            asyncio.run(rollouter.collect_batch(step, 100 * step, always("ok")))
    said = [r.getMessage() for r in caplog.records if "have reward spread" in r.getMessage()]
    assert [m.split(":")[0] for m in said] == ["step 0", "step 2"]  # 7, 7, 5 (fewer), 7
    assert "only 5 of 8 groups" in said[1] and "said again only if a step keeps fewer" in said[1]
