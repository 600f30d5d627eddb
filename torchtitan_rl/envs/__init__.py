"""Environments by name or import path; `build_environment` turns `[env]` into one."""

from __future__ import annotations

import importlib
from typing import Any

from torchtitan_rl.envs.alphabet_sort import AlphabetSort
from torchtitan_rl.envs.base import (
    EnvConfig,
    Environment,
    MessageEnv,
    RewardFn,
    Rubric,
    StepResult,
)
from torchtitan_rl.envs.calculator import Calculator
from torchtitan_rl.envs.countdown import Countdown

ENVS: dict[str, type[Environment]] = {
    "alphabet_sort": AlphabetSort,
    "countdown": Countdown,
    "calculator": Calculator,
}
"""The built-in environments, by the name `env.name` selects."""


def resolve_environment(name: str) -> type[Environment]:
    """A built-in name, or "package.module:ClassName" of an `Environment` subclass."""
    if ":" not in name:
        if name not in ENVS:
            raise ValueError(
                f"env.name must be one of {sorted(ENVS)} or 'package.module:ClassName', "
                f"got {name!r}"
            )
        return ENVS[name]
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"env.name={name!r}: cannot import {module_name!r} ({e})") from e
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(
            f"env.name={name!r}: {module_name} has no Environment subclass {class_name!r}"
        )
    return cls


def build_environment(config: EnvConfig, seed: int, args: Any = None) -> Environment:
    """Build `config.name` with `args`, an instance of its `config_class` (None: defaults)."""
    return resolve_environment(config.name)(config, seed, args)


__all__ = [
    "ENVS",
    "EnvConfig",
    "Environment",
    "MessageEnv",
    "RewardFn",
    "Rubric",
    "StepResult",
    "build_environment",
    "resolve_environment",
]
