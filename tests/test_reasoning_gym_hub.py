"""reasoning-gym datasets by name: their config checked, their prompts, their scorer, a split
that shares no question, gold-answer demonstrations, and two RL steps through Monarch."""

import asyncio
import re
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from driver import drive  # noqa: E402
from fakes import FakeRenderer, ScriptedGenerate  # noqa: E402

from torchtitan_rl.config import ConfigError, load_config, to_toml  # noqa: E402
from torchtitan_rl.envs import build_environment  # noqa: E402
from torchtitan_rl.rollout.rollout_config import RolloutConfig
from torchtitan_rl.rollout.rollouter import Rollouter  # noqa: E402
from torchtitan_rl.types import RolloutStatus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "spell_backward_tiny.toml"
NAME = "reasoning_gym:spell_backward"


def _config(*overrides: str, path=None):
    return load_config(path, [f"--env.name={NAME}", "--warm_start.steps=0", *overrides])


def _env(*overrides: str):
    config = _config(*overrides)
    return build_environment(config.env, config.job.seed, config.env_args())


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("--env.args.max_len=4", f"env.args of {NAME!r}: unknown key env.args.max_len"),
        ("--env.args.max_word_len=two", "env.args.max_word_len: expected int"),
        ("--env.args.max_word_len=2", "max_word_len must be >= min_word_len"),  # its assert
        ("--env.args.system_prompt=terse", "system_prompt must be one of"),
        ("--env.name=reasoning_gym:spell_backwards", "no dataset 'spell_backwards'"),
    ],
)
def test_env_args_are_checked_against_the_datasets_own_config(override, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        _config(override)
    assert "\n" not in str(info.value)


def test_env_args_reach_the_dataset_and_the_job_seed_is_its_default_seed():
    env = _env("--env.args.min_word_len=6", "--env.args.max_word_len=6", "--job.seed=3")
    assert env.dataset.seed == 3 and env.dataset.config.max_word_len == 6
    words = [env.train_sample(i)["question"].rsplit(" ", 1)[1] for i in range(30)]
    assert all(len(w) == 6 for w in words)
    assert _env("--env.args.seed=9").dataset.seed == 9


def test_the_saved_config_reloads_enums_tuples_and_an_unset_seed(tmp_path):
    from reasoning_gym.algorithmic.word_sorting import TextTransformation

    config = load_config(
        None,
        [
            "--env.name=reasoning_gym:word_sorting",
            "--env.args.transformation=uppercase",  # an Enum, set by its value
            "--env.args.seed=5",  # Optional[int]
            "--warm_start.steps=0",
        ],
    )
    assert config.env_args().transformation is TextTransformation.UPPERCASE
    unset = _config()  # spell_backward's seed stays None: omitted (TOML has no null)
    assert "seed =" not in to_toml(unset).split("[env.args]")[1].split("[")[0]
    for job in (config, unset):
        (tmp_path / "saved.toml").write_text(to_toml(job))
        assert load_config(tmp_path / "saved.toml").env_args() == job.env_args()
    with pytest.raises(ConfigError, match="transformation must be one of 'lowercase'"):
        load_config(None, ["--env.name=reasoning_gym:word_sorting", "--env.args.transformation=x"])


def test_a_list_of_enums_is_set_by_their_values_item_by_item(tmp_path):
    from reasoning_gym.logic.aiw import TaskType

    aiw = ["--env.name=reasoning_gym:aiw", "--warm_start.steps=0"]
    one = ['--env.args.task_types=["friends"]', "--env.args.task_type_weights=[1]"]
    config = load_config(None, [*aiw, *one])
    assert config.env_args().task_types == [TaskType.FRIENDS]
    assert config.env_args().task_type_weights == [1.0]  # an int item of list[float]
    env = build_environment(config.env, 0, config.env_args())
    assert all("female friends" in env.train_sample(i)["question"] for i in range(20))
    (tmp_path / "saved.toml").write_text(to_toml(config))
    assert load_config(tmp_path / "saved.toml").env_args() == config.env_args()
    with pytest.raises(ConfigError, match=re.escape("env.args.task_types[1] must be one of")):
        load_config(None, [*aiw, '--env.args.task_types=["friends", "cousins"]'])
    with pytest.raises(ConfigError, match=re.escape("task_type_weights[0]: expected float")):
        load_config(None, [*aiw, '--env.args.task_type_weights=["a"]'])
    poly = ["--env.name=reasoning_gym:polynomial_multiplication", "--warm_start.steps=0"]
    config = load_config(None, [*poly, '--env.args.variables=["x", "y"]'])  # a tuple[str]
    assert config.env_args().variables == ("x", "y")
    (tmp_path / "saved.toml").write_text(to_toml(load_config(None, poly)))  # default x, y, z
    assert load_config(tmp_path / "saved.toml").env_args().variables == ("x", "y", "z")


def test_a_default_that_disagrees_with_its_annotation_reloads(tmp_path):
    # intermediate_integration annotates `symbols: tuple` but defaults to "x"
    integration = ["--env.name=reasoning_gym:intermediate_integration", "--warm_start.steps=0"]
    config = load_config(None, integration)
    assert config.env_args().symbols == "x"
    (tmp_path / "saved.toml").write_text(to_toml(config))
    assert load_config(tmp_path / "saved.toml").env_args() == config.env_args()
    # a str for a tuple field whose default is a tuple is still an error
    with pytest.raises(ConfigError, match=re.escape("env.args.operators: expected tuple")):
        load_config(None, [*integration, "--env.args.operators=+"])


def test_size_is_the_pool_of_item_indices():
    env = _env("--env.args.size=40")
    indices = {env.train_sample(i)["index"] for i in range(200)}
    assert indices <= set(range(40)) and len(indices) > 20


def test_train_and_validation_share_no_question():
    env = _env("--env.args.size=3000", "--env.args.max_word_len=4")
    train = {env.train_sample(i)["question"] for i in range(-200, 2000)}
    validation = {s["question"] for s in env.validation_samples(300)}
    assert len(validation) > 100 and len(train) > 1000
    assert not train & validation
    assert env.validation_samples(5) == env.validation_samples(5)


def test_prompts_come_from_the_dataset_with_its_system_prompt():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    env = _env()
    sample = env.train_sample(0)
    entry = env.dataset[sample["index"]]
    messages = asyncio.run(env.make_env(sample).init())
    assert messages == [
        {"role": "system", "content": SYSTEM_PROMPTS["direct"]},
        {"role": "user", "content": entry["question"]},
    ]
    bare = asyncio.run(_env("--env.args.system_prompt=").make_env(sample).init())
    assert bare == [{"role": "user", "content": entry["question"]}]


def _rollouter(env, group_size=4):
    rollout = RolloutConfig(group_size=group_size, prompts_per_step=1)
    return Rollouter(env, FakeRenderer(), env.config, rollout, seed=0)


def test_rewards_come_from_the_datasets_scorer():
    env = _env()
    sample = env.train_sample(0)
    gold = sample["answer"]
    replies = [f"<answer>{gold}</answer>", f"<answer>{gold[0]}??</answer>", gold, "<answer>"]
    generate = ScriptedGenerate(lambda call: replies[int(call.request_id.split("=")[3][0])])
    group = asyncio.run(_rollouter(env).run_group_rollouts(sample, generate, group_id=0, step=1))
    rewards = [r.reward for r in group.rollouts]
    entry = env.dataset[sample["index"]]
    assert rewards[0] == 1.0 and rewards[2] == rewards[3] == 0.0  # no <answer> block: 0
    assert rewards[1] == env.dataset.score_answer(f"{gold[0]}??", entry) == 1 / len(gold)
    assert group.rollouts[0].reward_breakdown == {"score_answer": 1.0}


def _prime_factorization(*overrides: str):
    config = _config("--env.name=reasoning_gym:prime_factorization", *overrides)
    return build_environment(config.env, config.job.seed, config.env_args())


@pytest.mark.parametrize("workers", [0, 1])  # 1: the environment pickles to a worker
def test_a_scorer_that_raises_on_a_malformed_reply_scores_it_zero_and_trains_on_it(workers):
    from torchtitan_rl.controller.metrics import batch_metrics
    from torchtitan_rl.rollout.rollouter import CollectedBatch

    env = _prime_factorization(f"--env.workers={workers}")
    sample = env.train_sample(0)
    replies = [f"<answer>{sample['answer']}</answer>", "<answer>seven</answer>"]
    entry = env.dataset[sample["index"]]
    with pytest.raises(ValueError, match="invalid literal for int"):
        env.dataset.score_answer("seven", entry)  # the dataset's own scorer raises
    generate = ScriptedGenerate(lambda call: replies[int(call.request_id.split("=")[3][0])])
    rollouter = _rollouter(env, 2)
    try:
        group = asyncio.run(rollouter.run_group_rollouts(sample, generate, group_id=0, step=1))
    finally:
        rollouter.close()
    right, malformed = group.rollouts
    assert {right.status, malformed.status} == {RolloutStatus.COMPLETED}
    assert (right.reward, malformed.reward) == (1.0, 0.0)
    assert malformed.reward_breakdown == {"score_answer": 0.0}
    assert malformed.scorer_error == (
        "score_answer: ValueError: invalid literal for int() with base 10: 'seven'"
    )
    assert right.scorer_error is None
    batch = CollectedBatch(groups=[group], next_index=1, rounds=1, filtered=[])
    metrics = batch_metrics(batch)
    assert metrics["rollout/scorer_raised"] == 1.0 and metrics["rollout/num_error_rollouts"] == 0
    assert metrics["rollout_reward/zero_std_frac"] == 0.0  # a group with spread: it trains


@pytest.mark.parametrize(("max_error_steps", "stops_at"), [(2, 4), (0, None)])
def test_a_scorer_that_raises_on_every_rollout_stops_the_run_after_max_error_steps(
    tmp_path, max_error_steps, stops_at
):
    from torchtitan_rl.controller.diagnostics import RunCannotLearn, StepDiagnostics

    env = _prime_factorization()
    diagnostics = StepDiagnostics(tmp_path, env.config, 8, max_error_steps)
    rollouter = _rollouter(env, 2)
    sample = env.train_sample(0)
    scripts = {1: ["seven", "eight"], 2: ["seven", sample["answer"]], 3: ["x", "y"], 4: ["x", "y"]}
    stopped = None
    for step, replies in scripts.items():
        generate = ScriptedGenerate(
            lambda call, r=replies: f"<answer>{r[int(call.request_id.split('=')[3][0])]}</answer>"
        )
        group = asyncio.run(rollouter.run_group_rollouts(sample, generate, group_id=0, step=step))
        try:
            diagnostics.report(step, [group])
        except RunCannotLearn as e:
            stopped, message = step, str(e)
            break
    assert stopped == stops_at  # step 2 had a scored reply: the count starts again
    if stops_at:
        assert message.startswith(
            "every rollout errored (scorer_raised) in 2 steps in a row (RL steps 3-4)"
        )
        assert "(rollout.max_error_steps=2)" in message
        assert "first error: score_answer: ValueError: invalid literal for int()" in message


def test_a_scorer_raising_for_a_bug_is_scored_zero_too_and_said(monkeypatch, tmp_path, caplog):
    """A scorer cannot tell a bug from a malformed reply: a KeyError scores 0 as well, and the
    step's line names it (a scorer that always raises stops the run, test above)."""
    import logging

    from torchtitan_rl.controller.diagnostics import StepDiagnostics

    env = _env()

    def broken(answer, entry):
        raise KeyError("metadata")

    monkeypatch.setattr(env.dataset, "score_answer", broken)
    generate = ScriptedGenerate(lambda call: "<answer>x</answer>")
    sample = env.train_sample(0)
    group = asyncio.run(_rollouter(env, 2).run_group_rollouts(sample, generate, group_id=0, step=1))
    assert {r.status for r in group.rollouts} == {RolloutStatus.COMPLETED}
    assert group.rollouts[0].scorer_error == "score_answer: KeyError: 'metadata'"
    logging.getLogger("torchtitan_rl").propagate = True
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl"):
        StepDiagnostics(tmp_path, env.config, 8, max_error_steps=5).report(1, [group])
    assert (
        "step 1: all 2 rollouts scored 0 because the scorer raised on the reply "
        "(rollout.max_error_steps=5 such steps in a row stop the run; counted in "
        "rollout/scorer_raised), first: score_answer: KeyError: 'metadata'" in caplog.text
    )


def test_demonstrations_answer_with_the_gold_answer_which_scores_one():
    env = _env()
    for i in range(1, 30):
        sample = env.train_sample(-i)
        demo = env.demonstration(sample)
        assert demo[:-1] == asyncio.run(env.make_env(sample).init())
        assert demo[-1] == {"role": "assistant", "content": f"<answer>{sample['answer']}</answer>"}
        assert env.dataset.score_answer(sample["answer"], env.dataset[sample["index"]]) == 1.0
    with pytest.raises(ValueError, match="has no gold answer"):
        env.demonstration({**sample, "answer": None})


def test_a_hub_that_is_not_installed_is_one_line(monkeypatch):
    from torchtitan_rl.envs import reasoning_gym_hub

    reasoning_gym_hub.reasoning_gym_environment.cache_clear()
    monkeypatch.setattr(reasoning_gym_hub.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=re.escape("needs reasoning-gym, which is not installed")):
        _config()
    reasoning_gym_hub.reasoning_gym_environment.cache_clear()


@pytest.mark.parametrize("name", ["spell_backward_tiny", "number_filtering_tiny", "aiw_tiny"])
def test_each_reasoning_gym_config_loads_and_its_demonstrations_fit(name):
    from torchtitan_rl.models.renderer import Renderer
    from torchtitan_rl.models.tokenizer import Tokenizer

    config = load_config(ROOT / "train_configs" / f"{name}.toml")
    env = build_environment(config.env, 0, config.env_args())
    renderer = Renderer(Tokenizer.from_file(None))
    demos = [env.demonstration(env.train_sample(-i)) for i in range(1, 200)]
    longest = max(len(renderer.render_prompt(d)) for d in demos)
    assert longest <= min(config.batcher.seq_len, config.env.max_rollout_tokens)
    answers = [len(renderer.tokenizer.encode(d[-1]["content"])) for d in demos]
    assert max(answers) < config.rollout.max_tokens  # room for the stop token


@pytest.mark.slow
def test_spell_backward_trains_two_rl_steps_through_monarch(tmp_path):
    config = load_config(
        CONFIG,
        [
            f"--job.output_dir={tmp_path}",
            "--training.steps=2",
            "--warm_start.steps=2",
            "--warm_start.target_loss=0",
            "--warm_start.batch_size=4",
            "--rollout.group_size=4",
            "--rollout.prompts_per_step=2",
            "--rollout.filter_zero_std_groups=false",
            "--validation.num_samples=4",
            "--checkpoint.interval=0",
        ],
    )

    run = drive(config, steps=2, validate=True)
    steps, validation = run.steps, run.validation
    assert [m["trainer/policy_version"] for m in steps] == [3, 4]
    assert all(
        m["rollout/num_rollouts"] == 8 and m["rollout/num_error_rollouts"] == 0 for m in steps
    )
    assert 0.0 <= validation <= 1.0
