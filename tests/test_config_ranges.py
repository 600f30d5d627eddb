"""Numeric keys out of range, NaN or inf are one ConfigError naming key, value and range."""

from pathlib import Path

import pytest

from torchtitan_rl.checks import check_range
from torchtitan_rl.config import ConfigError, load_config
from torchtitan_rl.types import SamplingParams

TINY = Path(__file__).resolve().parents[1] / "train_configs" / "alphabet_sort_tiny.toml"


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("--training.lr=nan", "training.lr must be finite and > 0, got nan"),
        ("--training.lr=inf", "training.lr must be finite and > 0, got inf"),
        ("--training.lr=0", "training.lr must be finite and > 0, got 0.0"),
        ("--training.warmup_steps=-1", "training.warmup_steps must be >= 0, got -1"),
        ("--training.weight_decay=nan", "training.weight_decay must be finite and >= 0, got nan"),
        ("--training.weight_decay=-0.1", "training.weight_decay must be finite and >= 0"),
        ("--training.max_grad_norm=nan", "training.max_grad_norm must be finite and >= 0, got nan"),
        ("--training.max_grad_norm=-1", "training.max_grad_norm must be finite and >= 0, got -1"),
        ("--training.max_grad_norm=inf", "training.max_grad_norm must be finite and >= 0, got inf"),
        ("--training.lr_decay_to=nan", "training.lr_decay_to must be in [0, 1], got nan"),
        ("--warm_start.lr=nan", "warm_start.lr must be finite and > 0, got nan"),
        ("--warm_start.lr=-1", "warm_start.lr must be finite and > 0, got -1"),
        ("--warm_start.target_loss=inf", "warm_start.target_loss must be finite and >= 0, got inf"),
        ("--loss.entropy_coef=nan", "loss.entropy_coef must be finite and >= 0, got nan"),
        ("--loss.kl_coef=nan", "loss.kl_coef must be finite and >= 0, got nan"),
        ("--loss.kl_coef=inf", "loss.kl_coef must be finite and >= 0, got inf"),
        (
            "--loss.clip_low=nan",
            "loss.clip_low must be in [0, 0.99999999793",
        ),
        (
            "--loss.clip_high=inf",
            "loss.clip_high must be in [0, 485165194.4",
        ),
        ("--loss.clip_high=5e8", "loss.clip_high must be in [0, 485165194.4"),
        ("--loss.dr_grpo_normalizer=nan", "loss.dr_grpo_normalizer must be finite and > 0"),
        ("--correction.ratio_min=nan", "correction.ratio_min must be finite and >= 0, got nan"),
        ("--correction.ratio_max=nan", "correction.ratio_max must be > 0 (inf allowed), got nan"),
        ("--correction.opsm_delta=inf", "correction.opsm_delta must be finite and >= 0, got inf"),
        ("--rollout.temperature=nan", "rollout.temperature must be finite and > 0"),
        ("--rollout.temperature=inf", "rollout.temperature must be finite and > 0"),
        ('--rollout.stop=["</answer>", ""]', "rollout.stop: an empty text would end every turn"),
        ("--rollout.top_p=nan", "rollout.top_p must be in (0, 1], got nan"),
        ("--rollout.max_sampling_rounds=-1", "rollout.max_sampling_rounds must be >= 0, got -1"),
        ("--generator.max_num_seqs=0", "generator.max_num_seqs must be >= 1, got 0"),
        ("--generator.num_blocks=-1", "generator.num_blocks must be 0 or >="),
        ("--generator.gpu_memory_gib=-1", "generator.gpu_memory_gib must be finite and >= 0"),
        ("--training.gpu_memory_gib=nan", "training.gpu_memory_gib must be finite and >= 0"),
        ("--env.step_timeout_s=nan", "env.step_timeout_s must be a finite number > 0"),
        ("--env.workers=-1", "env.workers must be >= 0 (0: on the event loop), got -1"),
        ("--env.args.reward_power=inf", "env.args.reward_power must be finite and > 0, got inf"),
        (
            "--training.steps=99999999999999999999999",
            "training.steps must fit in 64 bits (|value| < 2**63), got 99999999999999999999999",
        ),
        ("--job.seed=-9223372036854775809", "job.seed must fit in 64 bits"),
        (
            "--training.minibatches=1000",  # the tiny job: 16 groups (prompts) per step
            "training.minibatches=1000 exceeds rollout.prompts_per_step=16: a minibatch holds "
            "whole groups (one per prompt); use training.minibatches <= 16",
        ),
    ],
)
def test_out_of_range_numbers_name_key_value_and_range(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    "override, value",
    [
        ("--correction.ratio_max=inf", float("inf")),  # its docstring: inf leaves it open
        ("--training.max_grad_norm=0", 0.0),  # 0 disables clipping
        ("--training.warmup_steps=0", 0),
        ("--training.steps=9223372036854775807", 2**63 - 1),  # the largest TOML integer
        ("--training.minibatches=16", 16),  # one group per minibatch
        ("--generator.block_size=0", 0),  # the backend's default (the tiny job's own value)
    ],
)
def test_documented_edge_values_are_accepted(override, value):
    section, key = override[2:].split("=")[0].split(".")
    assert getattr(getattr(load_config(TINY, [override]), section), key) == value


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_sampling_params_reject_a_non_finite_or_negative_temperature(temperature):
    with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
        SamplingParams(temperature=temperature).validate()


@pytest.mark.parametrize("temperature", [1e-300, 5e-5])
def test_sampling_params_reject_a_temperature_too_small_to_divide_by(temperature):
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or >= 0.0001"):
        SamplingParams(temperature=temperature).validate()
    SamplingParams(temperature=1e-4).validate()


def test_sampling_params_bound_top_k():
    with pytest.raises(ValueError, match="top_k must be in"):
        SamplingParams(top_k=2**63).validate()


def test_check_range_describes_open_and_closed_bounds():
    with pytest.raises(ValueError, match=r"x must be in \(0, 1\], got 0"):
        check_range("x", 0, gt=0, le=1)
    with pytest.raises(ValueError, match=r"x must be < 2, got 2"):
        check_range("x", 2, lt=2)
    check_range("x", float("inf"), gt=0, allow_inf=True)
    check_range("x", 1, ge=1, le=1)


def test_help_states_the_group_size_validation_requires():
    from torchtitan_rl.config import Config, help_text

    assert "Sibling rollouts per prompt, >= 2 when training.steps > 0" in help_text(Config())
    with pytest.raises(ConfigError, match=r"use rollout.group_size >= 2"):
        load_config(TINY, ["--rollout.group_size=1"])
    overrides = ["--rollout.group_size=1", "--training.steps=0"]
    assert load_config(TINY, overrides).rollout.group_size == 1
