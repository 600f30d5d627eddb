"""Environments by name or import path; `build_environment` turns `[env]` into one."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torchtitan_rl.envs.alphabet_sort import AlphabetSort
from torchtitan_rl.envs.base import (
    EnvConfig,
    Environment,
    EpisodeEnvironment,
    MessageEnv,
    RewardFn,
    Rubric,
    StepResult,
)
from torchtitan_rl.envs.calculator import Calculator
from torchtitan_rl.envs.countdown import Countdown
from torchtitan_rl.envs.reasoning_gym_hub import reasoning_gym_environment
from torchtitan_rl.envs.verifiers_hub import verifiers_environment

ENVS: dict[str, type[Environment]] = {
    "alphabet_sort": AlphabetSort,
    "countdown": Countdown,
    "calculator": Calculator,
}
"""The built-in environments, by the name `env.name` selects."""

HUBS: dict[str, Callable[[str], type[Environment]]] = {
    "reasoning_gym": reasoning_gym_environment,
    "verifiers": verifiers_environment,
}
"""Environment hubs, by the prefix of `env.name = "<hub>:<name>"`: each maps the name to an
Environment class, importing the hub's package only then (ValueError if it is missing)."""


def resolve_environment(name: str) -> type[Environment]:
    """A built-in name, "<hub>:<name>" of a `HUBS` environment, or "package.module:ClassName"
    of an `Environment` subclass."""
    hub, _, hub_name = name.partition(":")
    if hub in HUBS:
        return HUBS[hub](hub_name)
    if ":" not in name:
        if name not in ENVS:
            raise ValueError(
                f"env.name must be one of {sorted(ENVS)}, '<hub>:<name>' with a hub of "
                f"{sorted(HUBS)}, or 'package.module:ClassName', got {name!r}"
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
    "HUBS",
    "EnvConfig",
    "Environment",
    "EpisodeEnvironment",
    "MessageEnv",
    "RewardFn",
    "Rubric",
    "StepResult",
    "build_environment",
    "resolve_environment",
]
