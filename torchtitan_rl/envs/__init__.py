"""Environments by name; `build_environment` turns the `[env]` section into one."""

from __future__ import annotations

from typing import Any

from torchtitan_rl.envs.alphabet_sort import AlphabetSort, AlphabetSortConfig
from torchtitan_rl.envs.base import (
    EnvConfig,
    Environment,
    MessageEnv,
    RewardFn,
    Rubric,
    StepResult,
)

ENVS: dict[str, type[Environment]] = {"alphabet_sort": AlphabetSort}
"""Every environment, by the name `env.name` selects."""

ENV_CONFIGS: dict[str, type] = {"alphabet_sort": AlphabetSortConfig}
"""Each environment's own config class (its TOML section is named like the env)."""


def build_environment(config: EnvConfig, seed: int, section: Any | None = None) -> Environment:
    """Build `config.name`; `section` is that env's own config (e.g. AlphabetSortConfig),
    None for its defaults."""
    if config.name not in ENVS:
        raise ValueError(f"env.name must be one of {sorted(ENVS)}, got {config.name!r}")
    expected = ENV_CONFIGS[config.name]
    if section is not None and not isinstance(section, expected):
        raise ValueError(
            f"the config section of env {config.name!r} must be a {expected.__name__}, "
            f"got {type(section).__name__}"
        )
    return ENVS[config.name](config, seed, section)


__all__ = [
    "ENVS",
    "ENV_CONFIGS",
    "AlphabetSortConfig",
    "EnvConfig",
    "Environment",
    "MessageEnv",
    "RewardFn",
    "Rubric",
    "StepResult",
    "build_environment",
]
