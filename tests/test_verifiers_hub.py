"""verifiers environments by name: two verifiers 0.4.0 environments written for the tests
(tests/vf_echo.py, single-turn; tests/vf_guess.py, multi-turn; in-memory tasks) run
unmodified; the tokens trained on are the tokens generated, with their log-probs; the reward
is their rubric's; failures are per-rollout error statuses; config mistakes are one line; and
two RL steps train through Monarch on the multi-turn one."""

import asyncio
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verifiers.v1")

from driver import drive  # noqa: E402
from fakes import IM_END, FakeRenderer, ScriptedGenerate, encode, make_completion  # noqa: E402

from torchtitan_rl.config import ConfigError, load_config, to_toml  # noqa: E402
from torchtitan_rl.envs import build_environment  # noqa: E402
from torchtitan_rl.rollout.episodes import rollout_to_episodes  # noqa: E402
from torchtitan_rl.rollout.records import read_records  # noqa: E402
from torchtitan_rl.rollout.rollout_config import RolloutConfig
from torchtitan_rl.rollout.rollouter import Rollouter, request_seed  # noqa: E402
from torchtitan_rl.types import FinishReason, RolloutStatus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ECHO = "verifiers:vf-echo"
GUESS = "verifiers:vf-guess"
ODD = 300
"""A token id the fake renderer never writes and parse_completion drops: a prompt that holds
it was built from the sampled ids, not from the text re-tokenized."""


def _config(name, *overrides, path=None):
    return load_config(path, [f"--env.name={name}", "--warm_start.steps=0", *overrides])


def _env(name, *overrides):
    config = _config(name, *overrides)
    return build_environment(config.env, config.job.seed, config.env_args())


def _play(env, sample, respond, group_size=2):
    """One group of `sample` against `respond(call, rollout_id, turn) -> text`; returns the
    group and {request_id: the completion generated}."""
    generated = {}

    def answer(call):
        rollout = int(re.search(r"/rollout=(\d+)/", call.request_id).group(1))
        turn = int(re.search(r"/turn=(\d+)$", call.request_id).group(1))
        text = respond(call, rollout, turn)
        completion = make_completion([*encode(text), ODD, IM_END], request_id=call.request_id)
        generated[call.request_id] = completion
        return completion

    generate = ScriptedGenerate(answer)
    rollout = RolloutConfig(group_size=group_size, prompts_per_step=1)
    rollouter = Rollouter(env, FakeRenderer(), env.config, rollout, seed=0)
    group = asyncio.run(rollouter.run_group_rollouts(sample, generate, group_id=0, step=1))
    return group, generated, generate


def test_the_shipped_example_taskset_scores_the_word_and_nothing_else(monkeypatch):
    """examples/vf_repeat.py, as the README runs it (examples/ on the path)."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    env = _env("verifiers:vf-repeat")
    sample = env.train_sample(0)
    word = env.tasks[sample["index"]].data.answer
    group, _, _ = _play(env, sample, lambda call, r, t: f" {word} " if r == 0 else word + "!")
    assert [r.reward for r in group.rollouts] == [1.0, 0.0]
    assert all(r.status == RolloutStatus.COMPLETED for r in group.rollouts)


def test_a_single_turn_episode_trains_on_the_generated_tokens_and_its_rubrics_reward():
    env = _env(ECHO)
    sample = env.train_sample(0)
    word = env.tasks[sample["index"]].data.answer
    group, generated, generate = _play(env, sample, lambda call, r, t: word if r == 0 else "no")
    right, wrong = group.rollouts
    assert [right.status, wrong.status] == [RolloutStatus.COMPLETED] * 2
    assert (right.reward, wrong.reward) == (2.0, 0.0)  # its @reward, at its weight 2.0
    assert right.reward_breakdown == {"verifiers_reward": 2.0}
    signals = right.turns[0].reward_signals
    assert signals == {
        "verifiers_reward": 2.0,
        "reward/exact": 1.0,
        "metric/reply_chars": float(len(word)),
    }
    messages = [
        {"role": "system", "content": "Reply with the word only."},
        {"role": "user", "content": f"Say {word}"},
    ]
    assert right.messages == [*messages, {"role": "assistant", "content": word}]
    (turn,) = right.turns
    request_id = f"{right.session_id}/turn=0"
    assert turn.completion is generated[request_id]  # its ids, log-probs and versions
    assert turn.prompt_ids.tolist() == FakeRenderer().render_prompt(messages).tolist()
    call = next(c for c in generate.calls if c.request_id == request_id)
    assert np.array_equal(call.prompt_ids, turn.prompt_ids)
    assert call.session_id == right.session_id
    assert call.sampling.seed == request_seed(0, 1, 0, 0, 0)  # the Rollouter's seed
    (episode,) = rollout_to_episodes(right)
    ids = turn.completion.token_ids_N
    assert episode.token_ids_L.tolist() == [*turn.prompt_ids, *ids]
    assert episode.loss_mask_L.tolist() == [False] * len(turn.prompt_ids) + [True] * len(ids)
    assert episode.logprobs_L[-len(ids) :].tolist() == turn.completion.logprobs_N.tolist()


def _guess_sample(env):
    """A training sample whose secret is at least 2 (two wrong guesses, 0 and 1, first)."""
    for index in range(100):
        sample = env.train_sample(index)
        if env.tasks[sample["index"]].data.secret >= 2:
            return sample, env.tasks[sample["index"]].data.secret
    raise AssertionError("no such sample")


def test_a_multi_turn_episode_extends_each_prompt_with_the_sampled_ids():
    env = _env(GUESS, "--env.max_turns=3")
    sample, secret = _guess_sample(env)
    guesses = ["0", "1", str(secret)]
    group, generated, _ = _play(env, sample, lambda call, r, t: guesses[t], group_size=1)
    (rollout,) = group.rollouts
    assert rollout.status is RolloutStatus.COMPLETED and rollout.reward == 1.0
    assert [t.assistant_text for t in rollout.turns] == guesses
    higher = [{"role": "user", "content": "higher"}]
    assert [t.env_messages for t in rollout.turns] == [higher, higher, []]
    renderer = FakeRenderer()
    for i, turn in enumerate(rollout.turns):
        assert turn.completion is generated[f"{rollout.session_id}/turn={i}"]
        if i:
            before = rollout.turns[i - 1]
            tail = renderer.render_continuation(higher, True).tolist()
            expected = [*before.prompt_ids, *before.completion.token_ids_N, *tail]
            assert turn.prompt_ids.tolist() == expected and ODD in expected
    (episode,) = rollout_to_episodes(rollout)  # one sequence: P0 + A0 + E0 + A1 + E1 + A2
    last = rollout.turns[-1]
    assert episode.token_ids_L.tolist() == [*last.prompt_ids, *last.completion.token_ids_N]
    assert int(episode.loss_mask_L.sum()) == sum(t.completion.num_tokens for t in rollout.turns)
    assert [m["role"] for m in rollout.messages] == ["system", "user"] + [
        "assistant",
        "user",
    ] * 2 + ["assistant"]


def test_env_max_turns_caps_the_episode_as_a_truncated_rollout():
    env = _env(GUESS, "--env.max_turns=2")
    sample, _ = _guess_sample(env)
    group, _, _ = _play(env, sample, lambda call, r, t: "0", group_size=1)
    (rollout,) = group.rollouts
    assert rollout.status is RolloutStatus.TRUNCATED_TURNS and len(rollout.turns) == 2
    assert rollout.reward == 0.0 and "verifiers_reward" in rollout.turns[-1].reward_signals


def test_max_concurrent_bounds_the_episodes_played_at_once():
    env = _env(GUESS, "--env.max_turns=2", "--env.args.max_concurrent=1")
    sample, _ = _guess_sample(env)
    _, _, generate = _play(env, sample, lambda call, r, t: "0")
    rollouts = [re.search(r"rollout=(\d+)", c.request_id).group(1) for c in generate.calls]
    assert len(rollouts) == 4 and rollouts[0] == rollouts[1] and rollouts[2] == rollouts[3]


def test_a_raising_reward_is_an_error_reward_rollout_never_a_zero():
    env = _env(ECHO, "--env.args.taskset.raise_in_reward=true")
    group, _, _ = _play(env, env.train_sample(0), lambda call, r, t: "x")
    assert {r.status for r in group.rollouts} == {RolloutStatus.ERROR_REWARD}
    error = group.rollouts[0].error
    assert error.startswith("TaskError: task EchoTask scoring: KeyError") and "own bug" in error
    assert group.rollouts[0].reward_breakdown == {}


def test_a_failed_generation_is_an_error_generator_rollout():
    env = _env(ECHO)

    def fail(call):
        return make_completion([], finish_reason=FinishReason.ERROR, request_id=call.request_id)

    rollouter = Rollouter(env, FakeRenderer(), env.config, RolloutConfig(group_size=1), seed=0)
    generate = ScriptedGenerate(fail)
    rollout = asyncio.run(
        rollouter.run_single_rollout(
            env.train_sample(0),
            generate,
            group_id=0,
            rollout_id=0,
            sampling=RolloutConfig().sampling_params(seed=0, max_tokens=8, stop_token_ids=()),
        )
    )
    assert rollout.status is RolloutStatus.ERROR_GENERATOR
    assert rollout.error.startswith("ProviderError: generator failed on step=0/group=0")
    assert len(generate.calls) == 1  # an invalid request is not retried by the chat program


def test_a_simulated_user_generates_too_but_only_the_trained_agent_is_trained():
    env = _env(  # verifiers' own Env; its user's persona prompt is long
        ECHO, "--env.args.id=user-sim", "--env.max_turns=3", "--env.max_rollout_tokens=2048"
    )
    sample = env.train_sample(0)
    word = env.tasks[sample["index"]].data.answer

    def respond(call, rollout, turn):
        if "/user/" not in call.request_id:
            return word  # the assistant, the trained agent
        return f"Say {word}" if turn == 0 else "###DONE###"  # the user opens, then ends it

    group, generated, generate = _play(env, sample, respond, group_size=1)
    (rollout,) = group.rollouts
    assert rollout.status is RolloutStatus.COMPLETED and rollout.reward == 2.0
    (turn,) = rollout.turns
    assert turn.completion is generated[f"{rollout.session_id}/turn=0"]
    assert rollout.messages == [
        {"role": "system", "content": "Reply with the word only."},
        {"role": "user", "content": f"Say {word}"},
        {"role": "assistant", "content": word},
    ]
    user = sorted(c.request_id for c in generate.calls if "/user/" in c.request_id)
    assert user == [f"{rollout.session_id}/user/turn={t}" for t in (0, 1)]
    assert {c.session_id for c in generate.calls} == {rollout.session_id}


def test_train_and_validation_share_no_task():
    env = _env(ECHO)
    train = {env.train_sample(i)["key"] for i in range(300)}
    validation = {s["key"] for s in env.validation_samples(30)}
    assert train and validation and not train & validation
    assert len(train | validation) == len(env.tasks)  # every task is on one side


@pytest.mark.parametrize(
    ("name", "overrides", "needle"),
    [
        ("verifiers:no-such-env", (), "env.name='verifiers:no-such-env': taskset 'no-such-env'"),
        ("verifiers:", (), "names no verifiers environment"),
        (ECHO, ("--env.args.taskset.num_taskz=3",), "env.args.taskset.num_taskz: Extra inputs"),
        (ECHO, ("--env.args.taskset.num_tasks=2",), "both splits need a task"),
        (
            GUESS,
            ("--env.args.env={player={harness={id='bash'}}}",),
            "env.args.env.player.harness: role 'player' runs harness 'bash'",
        ),
        (
            GUESS,
            ("--env.args.env={player={runtime={type='docker'}}}",),
            "env.args.env.player.runtime",
        ),
        (GUESS, ("--env.args.env={max_guesses='x'}",), "env.args.env.max_guesses: Input"),
        (
            GUESS,
            ("--env.args.env={taskset={}}",),
            "env.args.env.taskset: set it as env.args.taskset",
        ),
        (ECHO, ("--env.args.id=no-such-env",), "env.args.id='no-such-env'"),
    ],
)
def test_config_mistakes_are_one_line(name, overrides, needle):
    with pytest.raises((ConfigError, ValueError), match=re.escape(needle)) as info:
        _env(name, *overrides)
    assert "\n" not in str(info.value)


def test_the_saved_config_reloads_verifiers_own_nested_settings(tmp_path):
    config = _config(
        GUESS,
        "--env.args.env={max_guesses=2, player={max_turns=3}}",
        "--env.args.taskset.num_tasks=24",
    )
    saved = tmp_path / "config.toml"
    saved.write_text(to_toml(config))
    assert load_config(saved).env_args() == config.env_args()
    assert config.env_args().env == {"max_guesses": 2, "player": {"max_turns": 3}}


def test_verifiers_not_installed_is_one_line(monkeypatch):
    from torchtitan_rl.envs import verifiers_hub

    verifiers_hub.verifiers_environment.cache_clear()
    monkeypatch.setattr(verifiers_hub.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=re.escape("needs verifiers, which is not installed")):
        _config(ECHO)
    verifiers_hub.verifiers_environment.cache_clear()


@pytest.mark.slow
def test_a_multi_turn_verifiers_env_trains_two_rl_steps_through_monarch(tmp_path):
    config = _config(
        GUESS,
        f"--job.output_dir={tmp_path}",
        "--job.run_name=vf",
        "--training.steps=2",
        "--rollout.group_size=2",
        "--rollout.prompts_per_step=2",
        "--rollout.max_tokens=4",
        "--rollout.filter_zero_std_groups=false",
        "--loss.entropy_coef=0.01",  # a random policy scores 0 everywhere: still a gradient
        "--env.max_turns=2",
        "--env.args.env={max_guesses=2}",
        "--validation.num_samples=2",
        "--validation.max_tokens=4",
        "--checkpoint.interval=0",
        path=ROOT / "train_configs" / "alphabet_sort_tiny.toml",
    )

    run = drive(config, steps=2, validate=True, warm_start=False)
    steps, validation, run_dir = run.steps, run.validation, run.run_dir
    assert [m["trainer/policy_version"] for m in steps] == [1, 2]
    assert all(m["rollout/num_rollouts"] == 4 for m in steps)
    assert all(m["rollout/num_error_rollouts"] == 0 for m in steps)
    assert 0.0 <= validation <= 1.0
    records = read_records(run_dir / "rollouts" / "step_2.jsonl")
    assert records and all(r["status"] != "error_env" for r in records)
    turns = max(records, key=lambda r: len(r["turns"]))["turns"]
    assert 1 <= len(turns) <= 2 and all(t["num_tokens"] >= 1 for t in turns)
    assert "verifiers_reward" in turns[-1]["reward_signals"]
    if len(turns) == 2:  # the env's "higher"/"lower" came back as the user's turn
        assert turns[0]["env_messages"][0]["content"] in ("higher", "lower")
