import asyncio

import numpy as np
import pytest

from torchtitan_rl.envs.alphabet_sort import (
    NEW_MARK,
    TURN_SCORE,
    AlphabetSort,
    AlphabetSortConfig,
    expected_lines,
    gold_reply,
    load_names,
    score_turn,
    sort_names,
    user_prompt,
)
from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.models.tokenizer import Tokenizer
from torchtitan_rl.types import Completion, FinishReason, Rollout, RolloutTurn

SAMPLE = {
    "sort_by": "last",
    "names_per_turn": [["Mary Young", "Paul Adams"], ["Laura Hill", "Kevin Adams"]],
}


def make_env(max_turns: int = 2, seed: int = 0, **section) -> AlphabetSort:
    return AlphabetSort(EnvConfig(max_turns=max_turns), seed, AlphabetSortConfig(**section))


def turn_with(signals: dict[str, float]) -> RolloutTurn:
    completion = Completion(
        request_id="r",
        token_ids_N=np.zeros(1, dtype=np.int32),
        logprobs_N=np.zeros(1, dtype=np.float32),
        finish_reason=FinishReason.STOP,
    )
    return RolloutTurn(
        prompt_ids=np.zeros(1, dtype=np.int32),
        completion=completion,
        assistant_text="",
        reward_signals=signals,
    )


def test_sorting_by_first_name_breaks_ties_by_full_name():
    names = ["Mary Young", "Paul Adams", "Mary Brown", "Laura Hill"]
    assert sort_names(names, "first") == ["Laura Hill", "Mary Brown", "Mary Young", "Paul Adams"]


def test_sorting_by_last_name_breaks_ties_by_full_name():
    names = ["Mary Young", "Paul Adams", "Kevin Adams", "Laura Hill"]
    assert sort_names(names, "last") == ["Kevin Adams", "Paul Adams", "Laura Hill", "Mary Young"]


def test_later_turns_resort_all_names_and_mark_only_the_new_ones():
    assert expected_lines(SAMPLE, 0) == ["Paul Adams", "Mary Young"]
    assert expected_lines(SAMPLE, 1) == [
        "Kevin Adams" + NEW_MARK,
        "Paul Adams",
        "Laura Hill" + NEW_MARK,
        "Mary Young",
    ]
    assert gold_reply(SAMPLE, 1).startswith("<combined_alphabetical_sorted>\nKevin Adams // new")
    assert "<combined_alphabetical_sorted>" in user_prompt(SAMPLE, 1)
    assert "by last name" in user_prompt(SAMPLE, 0) and "Mary Young" in user_prompt(SAMPLE, 0)


def test_perfect_answer_scores_one_even_with_extra_whitespace_and_case():
    assert score_turn(gold_reply(SAMPLE, 0), SAMPLE, 0, 4.0) == 1.0
    sloppy = "Sure!\n<alphabetical_sorted>\n  paul   ADAMS \n\nMary Young\n</alphabetical_sorted>"
    assert score_turn(sloppy, SAMPLE, 0, 4.0) == 1.0


def test_missing_or_wrong_tag_scores_zero():
    assert score_turn("Paul Adams\nMary Young", SAMPLE, 0, 4.0) == 0.0
    assert score_turn("<alphabetical_sorted>\nPaul Adams\nMary Young", SAMPLE, 0, 4.0) == 0.0
    wrong_turn_tag = gold_reply(SAMPLE, 0)  # turn 2 expects the combined tag
    assert score_turn(wrong_turn_tag, SAMPLE, 1, 4.0) == 0.0


def test_partially_right_answer_scores_strictly_between_zero_and_one():
    swapped = "<alphabetical_sorted>\nMary Young\nPaul Adams\n</alphabetical_sorted>"
    assert 0.0 < score_turn(swapped, SAMPLE, 0, 4.0) < 1.0


def test_reward_power_is_applied_to_the_similarity_ratio():
    unmarked = "<combined_alphabetical_sorted>\nKevin Adams\nPaul Adams\nLaura Hill\nMary Young\n</combined_alphabetical_sorted>"
    ratio = score_turn(unmarked, SAMPLE, 1, 1.0)
    assert 0.0 < ratio < 1.0
    assert score_turn(unmarked, SAMPLE, 1, 4.0) == pytest.approx(ratio**4)


def test_rubric_averages_over_expected_turns_counting_a_missing_turn_as_zero():
    rubric = make_env().rubric()
    rollout = Rollout(group_id=0, rollout_id=0, session_id="s", sample=SAMPLE)
    rollout.turns = [turn_with({TURN_SCORE: 0.8})]  # truncated before turn 2
    reward, breakdown = rubric.score(rollout)
    assert reward == pytest.approx(0.4)
    assert breakdown == {"sort_score": pytest.approx(0.4)}
    rollout.turns.append(turn_with({}))  # played but never scored
    assert rubric.score(rollout)[0] == pytest.approx(0.4)


def sample_key(sample: dict) -> tuple[str, str]:
    return sample["sort_by"], str(sample["names_per_turn"])


def test_validation_samples_are_fixed_and_disjoint_from_training_samples():
    # One name, one turn: only 1600 contents, so 3000 unsplit draws would hit most of them.
    env = make_env(max_turns=1, min_names=1, max_names=1)
    validation = env.validation_samples(64)
    assert validation == make_env(max_turns=1, min_names=1, max_names=1).validation_samples(64)
    assert env.validation_samples(10) == validation[:10]
    train_keys = {sample_key(env.train_sample(i)) for i in range(3000)}
    assert len(train_keys) > 800
    assert train_keys.isdisjoint({sample_key(s) for s in validation})


def test_training_samples_are_deterministic_in_seed_and_index_with_distinct_names():
    env = make_env(max_turns=3)
    assert env.train_sample(5) == make_env(max_turns=3).train_sample(5)
    assert env.train_sample(5) != make_env(max_turns=3, seed=1).train_sample(5)
    pool = set(load_names())
    for index in range(50):
        sample = env.train_sample(index)
        names = [n for turn in sample["names_per_turn"] for n in turn]
        assert len(sample["names_per_turn"]) == 3
        assert all(1 <= len(turn) <= 5 for turn in sample["names_per_turn"])
        assert len(set(names)) == len(names) and set(names) <= pool
        assert sample["sort_by"] in ("first", "last")


def test_three_turn_episode_with_gold_answers_earns_reward_one():
    environment = make_env(max_turns=3)
    sample = environment.train_sample(7)
    env = environment.make_env(sample)
    rollout = Rollout(group_id=0, rollout_id=0, session_id="s", sample=sample)

    async def play() -> None:
        messages = await env.init()
        for turn in range(3):
            assert messages[-1]["role"] == "user"
            result = await env.step(gold_reply(sample, turn))
            rollout.turns.append(turn_with(result.reward_signals))
            assert result.done == (turn == 2)
            messages = result.messages
        assert messages == []
        with pytest.raises(RuntimeError):
            await env.step("again")

    asyncio.run(play())
    assert environment.rubric().score(rollout)[0] == 1.0


def test_demonstration_is_token_consistent_with_prompt_and_continuation_rendering():
    renderer = Renderer(Tokenizer.from_file())
    environment = make_env(max_turns=3)
    sample = environment.train_sample(11)
    demo = environment.demonstration(sample)
    assert [m["role"] for m in demo] == ["user", "assistant"] * 3
    env = environment.make_env(sample)

    async def rollout_ids() -> list[np.ndarray]:
        parts = [renderer.render_prompt(await env.init())]
        for turn in range(3):
            completion = renderer.tokenizer.encode(demo[2 * turn + 1]["content"])
            parts.append(np.asarray(completion + [renderer.tokenizer.im_end_id], np.int32))
            result = await env.step(renderer.parse_completion(parts[-1]))
            assert result.reward_signals[TURN_SCORE] == 1.0
            if not result.done:
                parts.append(renderer.render_continuation(result.messages, True))
        return parts

    ids, mask = renderer.render_demonstration(demo)
    np.testing.assert_array_equal(ids, np.concatenate(asyncio.run(rollout_ids())))


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"min_names": 0}, "env.args.min_names"),
        ({"min_names": 3, "max_names": 2}, "env.args.max_names"),
        ({"max_names": 6}, "env.args.max_names"),
        ({"reward_power": 0.0}, "env.args.reward_power"),
        ({"sort_by": "middle"}, "env.args.sort_by"),
    ],
)
def test_config_validate_names_the_bad_field(section, field):
    with pytest.raises(ValueError, match=field):
        AlphabetSortConfig(**section).validate()


def test_too_many_turns_for_the_name_pool_is_rejected():
    with pytest.raises(ValueError, match="env.max_turns"):
        make_env(max_turns=len(load_names()))
