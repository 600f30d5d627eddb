import asyncio

import pytest

from torchtitan_rl.envs import ENVS, build_environment, resolve_environment
from torchtitan_rl.envs.alphabet_sort import AlphabetSort, AlphabetSortConfig
from torchtitan_rl.envs.base import (
    EnvConfig,
    Environment,
    MessageEnv,
    Rubric,
    StepResult,
    WrongAnswer,
)
from torchtitan_rl.envs.split import is_validation, split_sample
from torchtitan_rl.types import Rollout


def make_rollout() -> Rollout:
    return Rollout(group_id=0, rollout_id=0, session_id="s", sample={"x": 2.0})


def test_rubric_returns_weighted_sum_and_unweighted_breakdown():
    rubric = Rubric([("double", lambda r: 2 * r.sample["x"], 0.5), ("one", lambda r: 1.0, 3.0)])
    total, breakdown = rubric.score(make_rollout())
    assert total == pytest.approx(0.5 * 4.0 + 3.0 * 1.0)
    assert breakdown == {"double": 4.0, "one": 1.0}


def test_rubric_lets_a_raising_reward_fn_propagate():
    def broken(rollout: Rollout) -> float:
        raise KeyError("turn_score")

    rubric = Rubric([("ok", lambda r: 1.0, 1.0), ("broken", broken, 1.0)])
    with pytest.raises(KeyError):
        rubric.score(make_rollout())


def test_rubric_scores_a_wrong_answer_raise_zero_and_keeps_its_line():
    def malformed(rollout: Rollout) -> float:
        raise WrongAnswer("ValueError: invalid literal for int() with base 10: 'seven'")

    rubric = Rubric([("ok", lambda r: 1.0, 0.5), ("answer", malformed, 2.0)])
    rollout = make_rollout()
    assert rubric.score(rollout) == (0.5, {"ok": 1.0, "answer": 0.0})
    assert (
        rollout.scorer_error
        == "answer: ValueError: invalid literal for int() with base 10: 'seven'"
    )
    fine = Rubric([("ok", lambda r: 1.0, 1.0)])
    fine.score(rollout)
    assert rollout.scorer_error is None  # scoring again says what this score saw


def test_rubric_rejects_duplicate_names_empty_lists_and_nonfinite_weights():
    with pytest.raises(ValueError, match="unique"):
        Rubric([("a", lambda r: 1.0, 1.0), ("a", lambda r: 0.0, 1.0)])
    with pytest.raises(ValueError, match="at least one"):
        Rubric([])
    with pytest.raises(ValueError, match="finite"):
        Rubric([("a", lambda r: 1.0, float("nan"))])
    for taken in ("mean", "std", "zero_std_frac", "turn_1"):  # would overwrite a metric
        with pytest.raises(ValueError, match=f"{taken!r} is taken by a metric"):
            Rubric([(taken, lambda r: 1.0, 1.0)])
    Rubric([("turn_score", lambda r: 1.0, 1.0), ("mean_gap", lambda r: 1.0, 0.0)])  # fine


def test_step_result_has_no_reward_signals_by_default():
    result = StepResult(messages=[], done=True)
    assert result.reward_signals == {}


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_turns", 0), ("max_rollout_tokens", 0), ("step_timeout_s", 0.0)],
)
def test_env_config_validate_names_the_bad_field(field, value):
    config = EnvConfig(**{field: value})
    with pytest.raises(ValueError, match=f"env.{field}"):
        config.validate()


def test_build_environment_rejects_unknown_name_listing_valid_ones():
    with pytest.raises(ValueError, match=r"env\.name.*alphabet_sort.*'nope'"):
        build_environment(EnvConfig(name="nope"), seed=0)


def test_build_environment_rejects_args_of_the_wrong_type():
    with pytest.raises(ValueError, match="AlphabetSortConfig"):
        build_environment(EnvConfig(), seed=0, args=EnvConfig())


def test_build_environment_passes_the_env_args():
    env = build_environment(EnvConfig(), seed=0, args=AlphabetSortConfig(sort_by="last"))
    assert isinstance(env, AlphabetSort) and ENVS["alphabet_sort"] is AlphabetSort
    assert env.train_sample(0)["sort_by"] == "last"


def test_an_import_path_names_an_environment_outside_the_package():
    assert resolve_environment("tests.fakes:FakeEnvironment").__name__ == "FakeEnvironment"
    with pytest.raises(ValueError, match="cannot import"):
        resolve_environment("no_such_module:Env")
    with pytest.raises(ValueError, match="no Environment subclass"):
        resolve_environment("tests.fakes:FakeRenderer")


class EchoEnv(MessageEnv):
    async def init(self):
        return [{"role": "user", "content": "say hi"}]

    async def step(self, assistant_message):
        score = float(assistant_message == "hi")
        return StepResult(messages=[], done=True, reward_signals={"turn_score": score})


class EchoEnvironment(Environment):
    def train_sample(self, index):
        return {"index": index}

    def validation_samples(self, n):
        return [{"index": -1 - i} for i in range(n)]

    def make_env(self, sample):
        return EchoEnv()

    def rubric(self):
        return Rubric([("hi", lambda r: r.turns[0].reward_signals["turn_score"], 1.0)])

    def demonstration(self, sample):
        return [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]


def test_a_user_environment_needs_only_the_five_methods():
    environment = EchoEnvironment(EnvConfig(name="echo"), seed=0)
    env = environment.make_env(environment.train_sample(0))
    assert asyncio.run(env.init())[0]["content"] == "say hi"
    result = asyncio.run(env.step("hi"))
    assert result.done and result.reward_signals == {"turn_score": 1.0}


def test_environment_validates_its_config_on_construction():
    with pytest.raises(ValueError, match="env.max_turns"):
        EchoEnvironment(EnvConfig(max_turns=0), seed=0)


def test_split_sample_is_deterministic_disjoint_and_says_when_a_split_is_empty():
    def draw(rng):
        return {"n": rng.randrange(1000)}

    def content(sample):
        return sample["n"]

    def one(split, index, seed=0):
        return split_sample("t", seed=seed, split=split, index=index, draw=draw, content=content)

    train = {one("train", i)["n"] for i in range(-50, 500)}
    validation = {one("validation", i)["n"] for i in range(100)}
    assert not train & validation and all(is_validation(n) for n in validation)
    assert one("train", 7) == one("train", 7) and [one("train", i) for i in range(5)] != [
        one("train", i, seed=1) for i in range(5)
    ]
    only_train = next(n for n in range(100) if not is_validation(n))
    with pytest.raises(RuntimeError, match="t: no validation sample"):
        split_sample(
            "t", seed=0, split="validation", index=0, draw=lambda rng: only_train, content=int
        )
