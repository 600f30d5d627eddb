"""An environment outside the package, exactly as docs/environments.md writes it (the README's
"Write an environment" links it), plugged in by import path: config errors name it, and it
trains two RL steps through Monarch."""

import re
import sys
from pathlib import Path

import pytest
from driver import drive

from torchtitan_rl.config import ConfigError, load_config, to_toml

ROOT = Path(__file__).resolve().parents[1]


GUIDE = ROOT / "docs" / "environments.md"


def guide_block(first_line: str, language: str) -> str:
    """The guide's fenced block of `language` whose first line is `first_line`."""
    blocks = re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    matches = [b for b in blocks if b.startswith(first_line)]
    assert len(matches) == 1, f"{GUIDE.name}: {len(matches)} {language} blocks start {first_line!r}"
    return matches[0]


@pytest.fixture
def arith_module(tmp_path, monkeypatch):
    """The guide's my_envs/arith.py, written into a folder outside the package."""
    folder = tmp_path / "user_code"
    (folder / "my_envs").mkdir(parents=True)
    (folder / "my_envs" / "arith.py").write_text(guide_block("# my_envs/arith.py", "python"))
    monkeypatch.syspath_prepend(str(folder))
    yield
    for name in [m for m in sys.modules if m.startswith("my_envs")]:
        del sys.modules[name]


def _config(tmp_path, *extra):
    """The guide's complete job file for the environment, run under tmp_path."""
    toml = tmp_path / "arith.toml"
    toml.write_text(guide_block("# my_envs/arith.toml", "toml"))
    return load_config(toml, [f"--job.output_dir={tmp_path}", "--job.run_name=arith", *extra])


def test_the_readme_environment_loads_by_import_path_with_its_args(tmp_path, arith_module):
    config = _config(tmp_path)
    args = config.env_args()
    assert type(args).__name__ == "ArithConfig" and args.max_operand == 20
    assert "[env.args]\nmax_operand = 20" in to_toml(config)


def test_the_readme_environment_validates_on_every_question_of_the_trained_range(
    tmp_path, arith_module
):
    """Validation asks each question training samples from (a tiny model memorises sums,
    so held-out questions would stay near 0 while it learns): what it trains, it is
    scored on."""
    from torchtitan_rl.envs import build_environment

    config = _config(tmp_path)
    env = build_environment(config.env, config.job.seed, config.env_args())
    trained = {(s["a"], s["b"]) for s in map(env.train_sample, range(-3000, 3000))}
    asked = {(s["a"], s["b"]) for s in env.validation_samples(config.validation.num_samples)}
    assert trained == {(a, b) for a in range(21) for b in range(10)}
    assert len(asked) == min(config.validation.num_samples, 210) and asked <= trained


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("--env.args.max_operands=3", "unknown key env.args.max_operands"),
        ("--env.args.max_operand=big", "env.args.max_operand: expected int"),
        ("--env.name=my_envs.arith:Nope", "no Environment subclass 'Nope'"),
        ("--env.name=my_envs.nothing:Arith", "cannot import 'my_envs.nothing'"),
    ],
)
def test_env_mistakes_are_one_line_errors_naming_the_environment(
    tmp_path, arith_module, override, needle
):
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        _config(tmp_path, override)
    assert "\n" not in str(info.value)


def test_an_environment_without_demonstrations_needs_warm_start_steps_0(tmp_path, arith_module):
    from my_envs.arith import Arith

    del Arith.demonstration  # the user did not write one
    try:
        with pytest.raises(ConfigError, match="warm_start.steps=400 needs demonstrations"):
            _config(tmp_path)
        assert _config(tmp_path, "--warm_start.steps=0").warm_start.steps == 0
    finally:
        sys.modules.pop("my_envs.arith")


@pytest.mark.slow
def test_the_readme_environment_trains_two_rl_steps_through_monarch(tmp_path, arith_module):
    config = _config(
        tmp_path,
        "--training.steps=2",
        "--warm_start.steps=2",
        "--warm_start.batch_size=4",
        "--rollout.group_size=4",
        "--rollout.prompts_per_step=2",
        "--rollout.max_tokens=8",
        "--rollout.filter_zero_std_groups=false",
        "--loss.entropy_coef=0.01",
        "--validation.interval=1",
        "--validation.num_samples=4",
        "--validation.max_tokens=8",
        "--checkpoint.interval=0",
    )

    run = drive(config, steps=2, validate=True)
    steps, validation = run.steps, run.validation
    assert [m["trainer/policy_version"] for m in steps] == [3, 4]
    # every rollout played and scored (a barely trained model rarely stops within 8 tokens,
    # so most are truncated; none errored)
    assert all(
        m["rollout/num_rollouts"] == 8 and m["rollout/num_error_rollouts"] == 0 for m in steps
    )
    assert 0.0 <= validation <= 1.0
