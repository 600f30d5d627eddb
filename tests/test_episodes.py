import asyncio

import numpy as np
from fakes import (
    IM_END,
    FakeEnvironment,
    FakeRenderer,
    ScriptedEnv,
    ScriptedGenerate,
    always,
    done,
    make_completion,
    reply,
)

from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.rollout.episodes import rollout_to_episodes
from torchtitan_rl.rollout.rollout_config import RolloutConfig
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.types import Rollout, RolloutStatus, RolloutTurn


def play_three_turns():
    env_config = EnvConfig(max_turns=4, max_rollout_tokens=1000, step_timeout_s=5.0)
    environment = FakeEnvironment(
        lambda s: ScriptedEnv([reply("two"), reply("three"), done()]),
        lambda r: 1.0,
        config=env_config,
    )
    rollouter = Rollouter(
        environment, FakeRenderer(), env_config, RolloutConfig(group_size=1), seed=0
    )
    group = asyncio.run(rollouter.run_group_rollouts({}, always("ok"), group_id=0, step=0))
    return group.rollouts[0]


def make_rollout(turns, advantage=0.5, status=RolloutStatus.COMPLETED):
    rollout = Rollout(group_id=4, rollout_id=2, session_id="s", sample={}, status=status)
    rollout.advantage = advantage
    for prompt, completion in turns:
        rollout.turns.append(
            RolloutTurn(
                prompt_ids=np.asarray(prompt, np.int32), completion=completion, assistant_text=""
            )
        )
    return rollout


def test_three_turn_rollout_is_one_episode_with_loss_on_exactly_the_assistant_tokens():
    rollout = play_three_turns()
    rollout.advantage = 0.25
    (episode,) = rollout_to_episodes(rollout)
    last = rollout.turns[-1]
    np.testing.assert_array_equal(
        episode.token_ids_L, np.concatenate([last.prompt_ids, last.completion.token_ids_N])
    )
    expected_mask = np.zeros(len(episode), dtype=bool)
    for turn in rollout.turns:
        start = len(turn.prompt_ids)
        expected_mask[start : start + turn.completion.num_tokens] = True
    np.testing.assert_array_equal(episode.loss_mask_L, expected_mask)
    assert episode.loss_mask_L.sum() == 3 * len([*b"ok", IM_END])
    np.testing.assert_array_equal(
        episode.advantages_L, np.where(expected_mask, np.float32(0.25), np.float32(0))
    )
    assert episode.token_ids_L.dtype == np.int32 and episode.logprobs_L.dtype == np.float32


def test_logprobs_and_advantages_align_with_assistant_tokens():
    a0 = make_completion([10, 11, 12])
    a1 = make_completion([20, 21])
    rollout = make_rollout([([1, 2], a0), ([1, 2, 10, 11, 12, 5, 6], a1)], advantage=-1.5)
    (episode,) = rollout_to_episodes(rollout)
    np.testing.assert_array_equal(episode.token_ids_L, [1, 2, 10, 11, 12, 5, 6, 20, 21])
    np.testing.assert_array_equal(episode.loss_mask_L, [0, 0, 1, 1, 1, 0, 0, 1, 1])
    np.testing.assert_allclose(
        episode.logprobs_L, [0, 0, -0.01, -0.02, -0.03, 0, 0, -0.01, -0.02], rtol=1e-6
    )
    np.testing.assert_array_equal(episode.advantages_L, [0, 0, -1.5, -1.5, -1.5, 0, 0, -1.5, -1.5])
    assert (episode.group_id, episode.rollout_id, episode.branch) == (4, 2, 0)


def test_branch_on_history_edit():
    a0 = make_completion([10, 11])
    a1 = make_completion([20])
    a2 = make_completion([30, 31])
    rollout = make_rollout(
        [
            ([1, 2], a0),
            ([1, 2, 10, 11, 5], a1),
            ([1, 2, 7, 5, 20, 6], a2),  # the env dropped A0 from the history
        ]
    )
    first, second = rollout_to_episodes(rollout)
    np.testing.assert_array_equal(first.token_ids_L, [1, 2, 10, 11, 5, 20])
    np.testing.assert_array_equal(first.loss_mask_L, [0, 0, 1, 1, 0, 1])
    np.testing.assert_array_equal(second.token_ids_L, [1, 2, 7, 5, 20, 6, 30, 31])
    np.testing.assert_array_equal(second.loss_mask_L, [0, 0, 0, 0, 0, 0, 1, 1])
    assert (first.branch, second.branch) == (0, 1)


def test_policy_versions_span_the_turns_of_the_episode():
    a0 = make_completion([10], policy_version=3)
    a1 = make_completion([20], policy_version=5)
    (episode,) = rollout_to_episodes(make_rollout([([1], a0), ([1, 10, 2], a1)]))
    assert (episode.policy_version_min, episode.policy_version_max) == (3, 5)


def test_support_csr_is_concatenated_over_loss_tokens_in_order():
    a0 = make_completion([10, 11], with_support=True)
    a1 = make_completion([20], with_support=True)
    (episode,) = rollout_to_episodes(make_rollout([([1], a0), ([1, 10, 11, 2], a1)]))
    np.testing.assert_array_equal(episode.support_offsets, [0, 2, 4, 6])
    np.testing.assert_array_equal(episode.support_ids, [10, 11, 11, 12, 20, 21])
    loss_tokens = episode.token_ids_L[episode.loss_mask_L]
    for i, token in enumerate(loss_tokens):
        kept = episode.support_ids[episode.support_offsets[i] : episode.support_offsets[i + 1]]
        assert token in kept


def test_error_rollout_produces_no_episodes():
    rollout = make_rollout([([1], make_completion([10]))], status=RolloutStatus.ERROR_ENV)
    assert rollout_to_episodes(rollout) == []


def test_truncated_rollout_still_produces_its_episode():
    rollout = make_rollout([([1], make_completion([10]))], status=RolloutStatus.TRUNCATED_LENGTH)
    assert len(rollout_to_episodes(rollout)) == 1


def test_gold_alphabet_sort_rollout_packs_to_the_rendered_demonstration():
    from torchtitan_rl.envs.alphabet_sort import AlphabetSort
    from torchtitan_rl.models.renderer import Renderer
    from torchtitan_rl.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(None)
    renderer = Renderer(tokenizer)
    env_config = EnvConfig(max_turns=3, max_rollout_tokens=4096, step_timeout_s=5.0)
    environment = AlphabetSort(env_config, seed=0)
    sample = environment.train_sample(0)
    gold = [m["content"] for m in environment.demonstration(sample) if m["role"] == "assistant"]

    def respond(call):
        turn = int(call.request_id.rsplit("turn=", 1)[1])
        ids = [*tokenizer.encode(gold[turn]), tokenizer.im_end_id]
        return make_completion(ids, request_id=call.request_id)

    rollouter = Rollouter(environment, renderer, env_config, RolloutConfig(group_size=1), seed=0)
    group = asyncio.run(
        rollouter.run_group_rollouts(sample, ScriptedGenerate(respond), group_id=0, step=0)
    )
    (rollout,) = group.rollouts
    assert rollout.status is RolloutStatus.COMPLETED and rollout.reward == 1.0
    assert len(rollout.turns) == 3
    (episode,) = rollout_to_episodes(rollout)
    ids_L, mask_L = renderer.render_demonstration(environment.demonstration(sample))
    np.testing.assert_array_equal(episode.token_ids_L, ids_L)
    np.testing.assert_array_equal(episode.loss_mask_L, mask_L)
