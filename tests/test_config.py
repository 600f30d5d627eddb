"""Config loading: TOML + overrides into typed sections; mistakes are one clear line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_rl.config import ConfigError, load_config, to_toml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "train_configs" / "alphabet_sort_tiny.toml"


def test_default_config_has_the_documented_keys():
    c = load_config(TINY)
    assert c.job.output_dir and c.job.run_name and isinstance(c.job.seed, int)
    assert c.training.steps > 0
    assert c.checkpoint.interval >= 0
    assert c.model.hf_checkpoint == ""
    assert c.env.name == "alphabet_sort" and c.env.max_turns >= 1


def test_overrides_are_typed_and_win_over_the_file():
    c = load_config(TINY, ["--env.max_turns=3", "--training.lr=0.01", "--job.run_name=abc"])
    assert c.env.max_turns == 3 and c.training.lr == 0.01 and c.job.run_name == "abc"


def test_int_is_accepted_for_a_float_field():
    assert load_config(TINY, ["--training.lr=1"]).training.lr == 1.0


@pytest.mark.parametrize(
    "override, needle",
    [
        ("--training.stepz=3", "training.stepz"),
        ("--nosection.key=1", "[nosection]"),
        ("--training.steps=many", "training.steps"),
        ("--training.steps=1.5", "training.steps"),
        ("--loss.name=ppo2", "loss.name"),
        ("--env.name=chess", "env.name"),
        ("--model.hf_checkpoint=/does/not/exist", "model.hf_checkpoint"),
        ("training.steps=3", "--section.key=value"),
        ("--rollout.stop=[1]", "rollout.stop[0]: expected str"),  # items of list[str]
        ("--lora.vllm_sync=merge", "lora.vllm_sync must be one of 'merged', 'adapters'"),
    ],
)
def test_user_mistakes_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(TINY, [override])
    assert needle in str(e.value)


def test_training_compile_is_off_by_default_and_must_be_a_bool():
    from torchtitan_rl.training.trainer_config import TrainingConfig

    assert load_config(TINY).training.compile is False
    assert load_config(TINY, ["--training.compile=true"]).training.compile is True
    with pytest.raises(ConfigError, match="training.compile"):
        load_config(TINY, ["--training.compile=yes"])
    with pytest.raises(ValueError, match="training.compile must be true or false, got 1"):
        TrainingConfig(compile=1).validate()


def test_toml_syntax_error_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[job\nseed = 1\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path):
    c = load_config(TINY, ["--env.max_turns=3"])
    saved = tmp_path / "config.toml"
    saved.write_text(to_toml(c))
    assert load_config(saved) == c


@pytest.mark.parametrize(
    "args, env, needle",
    [
        (["--training.stepz=3"], {}, "training.stepz"),
        ([], {"CONFIG_FILE": "missing.toml"}, "missing.toml"),
        (["--model.hf_checkpoint=/nope"], {}, "model.hf_checkpoint"),
    ],
)
def test_cli_bad_input_is_one_line_no_traceback(args, env, needle):
    run = subprocess.run(
        [sys.executable, "-m", "torchtitan_rl.train", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0]


@pytest.mark.parametrize(
    "installed, overrides, needle",
    [
        (False, [], "needs vLLM, which is not installed"),
        (True, ["--generator.block_size=16"], "multiple of 32"),
        (True, ["--generator.decode_attention=gather"], "native only"),
        (True, ["--generator.backend=sglang"], "backend must be one of"),
        (True, ['--rollout.stop=["</answer>"]'], "native generator only"),
    ],
)
def test_vllm_backend_mistakes_are_one_line(monkeypatch, installed, overrides, needle):
    """generator.backend = "vllm" is checked before any process starts: vLLM missing, a CPU
    block size vLLM cannot use, a native-only key."""
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if installed else None) if name == "vllm" else found(name, *a),
    )
    args = ["--generator.backend=vllm", "--parallelism.device=cpu", *overrides]
    with pytest.raises(ConfigError) as e:
        load_config(TINY, args)
    assert needle in str(e.value)
    assert load_config(TINY).generator.backend == "native"


def test_the_kv_block_size_default_fits_the_backend_and_device(monkeypatch):
    """generator.block_size = 0 (the default): 16, or 32 for vLLM on CPU, which needs it."""
    import importlib.util

    from torchtitan_rl.generation.interface import EngineConfig

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "vllm" else found(name, *a),
    )
    config = load_config(TINY, ["--generator.backend=vllm", "--parallelism.device=cpu"])
    assert config.generator.block_size == 0
    assert config.generator.for_device("cpu").block_size == 32
    assert config.generator.for_device("cuda").block_size == 16
    assert EngineConfig().for_device("cpu").block_size == 16  # native
    assert EngineConfig(block_size=64).for_device("cpu").block_size == 64  # a set value stays


def _float_keys():
    import dataclasses
    import typing

    from torchtitan_rl.config import Config
    from torchtitan_rl.config.help import _field_docs

    config = Config()
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        hints = typing.get_type_hints(type(value))
        docs = _field_docs(type(value))
        for f in dataclasses.fields(value):
            if hints[f.name] is float:
                yield f"{section.name}.{f.name}", "inf" in docs.get(f.name, "")


@pytest.mark.parametrize("key, inf_documented", list(_float_keys()))
def test_every_float_key_is_finite_unless_its_docstring_says_otherwise(key, inf_documented):
    with pytest.raises(ConfigError, match=rf"^{key} must .*got nan"):
        load_config(None, [f"--{key}=nan"])
    if not inf_documented:
        with pytest.raises(ConfigError, match=rf"^{key} must .*got -?inf"):
            load_config(None, [f"--{key}=inf"])


def test_a_choice_lists_its_values_from_its_type():
    with pytest.raises(ConfigError, match=r"^parallelism.device must be one of 'auto', 'cpu', "
                       r"'cuda'; got 'gpu'$"):  # fmt: skip
        load_config(None, ["--parallelism.device=gpu"])
    from torchtitan_rl.config import Config, help_text

    assert 'parallelism.device ("auto" | "cpu" | "cuda") = "auto"' in help_text(Config())


@pytest.mark.parametrize(
    "overrides",
    [
        ["--env.name=countdown", "--env.args.max_number=20"],
        ["--env.args.max_number=20", "--env.name=countdown"],  # one command line, any order
    ],
)
def test_a_new_env_name_leaves_the_old_environments_args_behind(overrides):
    args = load_config(TINY, overrides).env_args()
    assert type(args).__name__ == "CountdownConfig" and args.max_number == 20
    # naming the same environment again keeps the file's settings
    kept = load_config(TINY, ["--env.name=alphabet_sort", "--env.args.max_names=3"]).env_args()
    assert kept.sort_by == "random" and kept.max_names == 3


def test_a_job_file_extends_another_next_to_it_or_in_the_repository(tmp_path):
    (tmp_path / "base.toml").write_text('[job]\nrun_name = "base"\n[training]\nlr = 0.01\n')
    (tmp_path / "child.toml").write_text('extends = "base.toml"\n[training]\nsteps = 3\n')
    child = load_config(tmp_path / "child.toml")
    assert (child.job.run_name, child.training.lr, child.training.steps) == ("base", 0.01, 3)
    # a bare name not next to the file comes from train_configs/; [env] alone gets a base
    (tmp_path / "countdown.toml").write_text(
        'extends = "alphabet_sort_tiny.toml"\n[env]\nname = "countdown"\n'
        "[env.args]\nmax_number = 20\n"
    )
    c = load_config(tmp_path / "countdown.toml")
    assert c.warm_start.steps == 400 and c.training.steps == 800  # the tiny job's, not defaults
    assert c.env_args().max_number == 20 and c.env_args().min_numbers == 3


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('extends = "nope.toml"\n', "extends = 'nope.toml': no such job file (looked in"),
        ('extends = "loop.toml"\n', "extends = 'loop.toml' makes a loop of job files"),
        ("extends = 3\n", "extends must name a job file (a string), got 3"),
    ],
)
def test_extends_mistakes_are_one_line(tmp_path, text, needle):
    (tmp_path / "loop.toml").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        load_config(tmp_path / "loop.toml")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("job", sorted(p.name for p in (ROOT / "train_configs").glob("*.toml")))
def test_every_committed_job_file_loads_and_its_environment_serves_prompts(job):
    """A key renamed in code but not in a committed job file would stop that job at start-up."""
    from torchtitan_rl.envs import build_environment

    config = load_config(ROOT / "train_configs" / job)
    if config.env.name.startswith("reasoning_gym:"):
        pytest.importorskip("reasoning_gym")
    environment = build_environment(config.env, config.job.seed, config.env_args())
    assert environment.train_sample(0) and environment.validation_samples(2)
