"""Loads a TOML job file into typed sections, applies `--section.key=value` overrides.

Each component owns its config dataclass next to its code; this module only composes
them. Every user mistake raises ConfigError with one line naming the key and what is valid.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import importlib.util
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli
import torch

from torchtitan_rl.config.job import (
    CheckpointConfig,
    JobConfig,
    ParallelismConfig,
    ValidationConfig,
)
from torchtitan_rl.config.launcher import LauncherConfig, check_hosts
from torchtitan_rl.envs import resolve_environment
from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.generation.backends import check_served_adapter_dtype, traits
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.losses.corrections import CorrectionConfig, check_objective
from torchtitan_rl.losses.policy_loss import KL_REFERENCE_BASE, LossConfig
from torchtitan_rl.models.lora import LoRAConfig
from torchtitan_rl.models.model_config import ModelConfig
from torchtitan_rl.rollout.advantages import AdvantageConfig
from torchtitan_rl.rollout.batcher import BatcherConfig
from torchtitan_rl.rollout.rollout_config import RolloutConfig
from torchtitan_rl.training.trainer_config import TrainingConfig, WarmStartConfig
from torchtitan_rl.weight_sync.config import WeightSyncConfig


class ConfigError(ValueError):
    """A user mistake in the job file or overrides; the message is the one line shown."""


@dataclass(kw_only=True, slots=True)
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    generator: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            check = getattr(section, "validate", None)
            if check is not None:
                try:
                    check()
                except ValueError as e:
                    msg = str(e)
                    raise ConfigError(
                        msg if "." in msg.split(" ")[0] else f"{f.name}: {msg}"
                    ) from e
        try:
            check_objective(self.loss, self.correction)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if self.loss.kl_reference == KL_REFERENCE_BASE and not self.lora.enabled:
            raise ConfigError(
                'loss.kl_reference = "base" is the LoRA base model and needs lora.rank > 0; '
                'use a Hugging Face folder or "" (the policy as RL starts)'
            )
        if self.warm_start.params == "adapters" and not self.lora.enabled:
            raise ConfigError(
                'warm_start.params = "adapters" trains LoRA adapters and needs lora.rank > 0; '
                'use "auto" or "all" (every weight)'
            )
        if self.rollout.group_size < 2 and self.training.steps > 0:
            raise ConfigError(
                "rollout.group_size=1: a group-relative advantage is 0 for every rollout, so "
                "no RL step would train anything; use rollout.group_size >= 2"
            )
        minibatches, staleness = self.training.minibatches, self.rollout.max_staleness
        if minibatches > self.rollout.prompts_per_step:
            raise ConfigError(
                f"training.minibatches={minibatches} exceeds rollout.prompts_per_step="
                f"{self.rollout.prompts_per_step}: a minibatch holds whole groups (one per "
                f"prompt); use training.minibatches <= {self.rollout.prompts_per_step}"
            )
        if 0 < staleness < minibatches:
            raise ConfigError(
                f"rollout.max_staleness={staleness} with training.minibatches={minibatches}: "
                f"one step already moves the policy {minibatches} versions, so no batch could "
                f"run ahead; use rollout.max_staleness = 0 or >= {minibatches}"
            )
        try:
            check_hosts(
                self.launcher, trainer_procs=self.parallelism.trainer_procs,
                tp=self.parallelism.tp, replicas=self.generator.num_replicas,
            )  # fmt: skip
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self._check_generator_backend()
        self.env_args()  # the environment exists and its settings are valid
        if self.warm_start.steps > 0 and not self.environment_class().has_demonstrations():
            raise ConfigError(
                f"warm_start.steps={self.warm_start.steps} needs demonstrations, but "
                f"env.name={self.env.name!r} does not implement demonstration(); "
                "set warm_start.steps = 0"
            )

    def _check_generator_backend(self) -> None:
        backend = self.generator.backend
        own = traits(backend)
        if self.rollout.stop and not own.stop_texts:
            raise ConfigError(
                f"rollout.stop={self.rollout.stop} works with the native generator only (the "
                f"{backend} backend generates token ids without text); use generator.backend = "
                '"native" or rollout.stop = []'
            )
        if own.package is not None and importlib.util.find_spec(own.package) is None:
            raise ConfigError(
                f'generator.backend = "{backend}" needs {own.label}, which is not installed: '
                f'{own.install_hint} or use generator.backend = "native"'
            )
        device = self.parallelism.device
        on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
        if self.lora.enabled and self.lora.vllm_sync == "adapters":
            try:
                check_served_adapter_dtype(backend, self.generator.dtype, on_gpu=not on_cpu)
            except ValueError as e:
                raise ConfigError(str(e)) from e
        multiple = own.cpu_block_multiple
        if on_cpu and self.generator.block_size % multiple:  # 0: resolved to a multiple
            raise ConfigError(
                f"generator.block_size={self.generator.block_size}: {own.label} on CPU needs a "
                f"multiple of {multiple}; use 0 (the backend's default) or e.g. {multiple}"
            )

    def environment_class(self):
        """The class `env.name` names; ConfigError if it cannot be found."""
        try:
            return resolve_environment(self.env.name)
        except ValueError as e:
            raise ConfigError(str(e)) from e

    def env_args(self) -> Any:
        """`env.args` as the environment's own config dataclass (defaults for unset keys),
        validated; None for an environment without settings. ConfigError names the key."""
        cls = self.environment_class()
        where = f"env.args of {self.env.name!r}"
        if cls.config_class is None:
            if self.env.args:
                raise ConfigError(
                    f"{where}: this environment takes no settings, got {self.env.args}"
                )
            return None
        args = cls.config_class()
        _apply_section(args, self.env.args, where, "env.args")
        check = getattr(args, "validate", None)
        if check is not None:
            try:
                check()
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from e
        return args


def _coerce_items(key: str, value: list | tuple, hint: Any) -> list:
    """The items of a TOML array checked against `list[X]`, `tuple[X, ...]`, `tuple[X]` (read
    as any length) or `tuple[X, Y]` (an enum item set by its value); a bare `list`/`tuple`
    keeps its items as they are."""
    args = typing.get_args(hint)
    if not args:
        return list(value)
    if len(args) == 1 or args[1:] == (Ellipsis,):  # any length (`tuple[str]` is often
        # written for a tuple of strings: reasoning-gym's polynomial_multiplication.variables)
        return [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if len(args) != len(value):
        raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}: {value!r}")
    return [_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args))]


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check a TOML value against a field's type; ints are accepted for floats."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:  # a fixed set of choices, listed by the type itself
        choices = typing.get_args(hint)
        if value not in choices or type(value) is not type(choices[0]):
            raise ConfigError(
                f"{key} must be one of {', '.join(map(repr, choices))}; got {value!r}"
            )
        return value
    if origin in (typing.Union, types.UnionType):  # Optional[X]: TOML has no null, so an X
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) == 1:
            return _coerce(key, value, options[0])
    if isinstance(hint, type) and issubclass(hint, enum.Enum):  # set by its value
        try:
            return hint(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in hint)
            raise ConfigError(f"{key} must be one of {choices}; got {value!r}") from None
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and not -(2**63) <= value < 2**63:  # TOML's integers are 64-bit; tomli reads more
            raise ConfigError(f"{key} must fit in 64 bits (|value| < 2**63), got {value}")
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    elif origin is tuple or hint is tuple:
        ok = isinstance(value, list | tuple)
        value = tuple(_coerce_items(key, value, hint)) if ok else value
    elif origin in (list, collections.abc.Sequence) or hint is list:
        ok = isinstance(value, list | tuple)
        value = _coerce_items(key, value, hint) if ok else value
    elif origin is dict:
        ok = isinstance(value, dict)
    else:  # a field type this loader cannot check: a bug in that dataclass, said plainly
        raise ConfigError(f"{key}: its field type {hint!r} cannot be set from TOML")
    if not ok:
        name = getattr(hint, "__name__", str(hint))
        raise ConfigError(f"{key}: expected {name}, got {type(value).__name__} {value!r}")
    return value


def _coerce_field(key: str, value: Any, hint: Any, default: Any) -> Any:
    """`_coerce`, except that a scalar of the very type of the field's default passes where
    the annotation disagrees with that default: a saved config writes the default, and it
    must load again (reasoning-gym's intermediate_integration has `symbols: tuple = "x"`)."""
    try:
        return _coerce(key, value, hint)
    except ConfigError:
        if not isinstance(default, str | int | float | bool) or type(value) is not type(default):
            raise
        try:
            _coerce(key, default, hint)
        except ConfigError:
            return value  # the annotation rejects its own default: the default's type is right
        raise


MOVED = {"launcher.weight_transport": "weight_sync.transport"}
"""Keys that moved to another section: old name -> new name (a one-line error says where)."""


def _apply_section(section: Any, values: dict[str, Any], source: str, name: str) -> None:
    """Set `values` on the dataclass `section`; `name` prefixes keys in errors. A dict
    field is updated key by key (a later --env.args.k=v keeps the file's other keys)."""
    hints = typing.get_type_hints(type(section))
    defaults = {f.name: f.default for f in dataclasses.fields(section)}
    valid = list(defaults)
    for key, value in values.items():
        if f"{name}.{key}" in MOVED:
            new = MOVED[f"{name}.{key}"]
            raise ConfigError(
                f"{source}: {name}.{key} moved to {new}; set {new} = {toml_value(value)}"
            )
        if key not in valid:
            raise ConfigError(f"{source}: unknown key {name}.{key}; valid keys: {valid}")
        value = _coerce_field(f"{name}.{key}", value, hints[key], defaults[key])
        if isinstance(value, dict):
            value = {**getattr(section, key), **value}
        setattr(section, key, value)


def _apply(config: Config, table: dict[str, Any], source: str) -> None:
    """Apply one source (a job file or one override). A source that moves `env.name` to
    another environment starts that environment's `[env.args]` afresh: the earlier
    environment's settings would be unknown keys to the new one."""
    sections = {f.name for f in dataclasses.fields(config)}
    for name, values in table.items():
        if name not in sections:
            raise ConfigError(f"{source}: unknown section [{name}]; valid: {sorted(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: '{name}' must be a [section] table")
        if name == "env" and values.get("name", config.env.name) != config.env.name:
            config.env.args = {}
        _apply_section(getattr(config, name), values, source, name)


def _parse_override(arg: str) -> dict[str, Any]:
    """`--section.key=value` (or `--env.args.key=value`) as the table it stands for."""
    if not arg.startswith("--") or "=" not in arg or "." not in arg.split("=", 1)[0]:
        raise ConfigError(f"bad argument {arg!r}: overrides look like --section.key=value")
    dotted, raw = arg[2:].split("=", 1)
    try:
        value = tomli.loads(f"v = {raw}")["v"]
    except tomli.TOMLDecodeError:
        value = raw  # bare strings need no quotes on the command line
    *path, key = dotted.split(".")
    table: dict[str, Any] = {key: value}
    for part in reversed(path):
        table = {part: table}
    return table


EXTENDS = "extends"
"""Top-level job-file key naming the job file it builds on: its keys first, this file's on
top. A relative name is read next to the extending file, else in the repository's
train_configs/ (so `extends = "alphabet_sort_tiny.toml"` works from any folder)."""
REPO_JOB_FILES = Path(__file__).resolve().parents[2] / "train_configs"


def _read_job_file(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[dict, str]]:
    """The tables of `path` and of the files it extends, base first, each with its name."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        table = tomli.loads(path.read_text())
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"{path}: TOML syntax error: {e}") from e
    base = table.pop(EXTENDS, None)
    if base is None:
        return [(table, str(path))]
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: {EXTENDS} must name a job file (a string), got {base!r}")
    found = Path(base)
    if not found.is_absolute():
        nearby, repo = path.parent / base, REPO_JOB_FILES / base
        found = repo if not nearby.is_file() and repo.is_file() else nearby
    if not found.is_file():
        raise ConfigError(
            f"{path}: {EXTENDS} = {base!r}: no such job file (looked in {path.parent} and "
            f"{REPO_JOB_FILES})"
        )
    chain = (*seen, path.resolve())
    if found.resolve() in chain:
        raise ConfigError(f"{path}: {EXTENDS} = {base!r} makes a loop of job files")
    return [*_read_job_file(found, chain), (table, str(path))]


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Defaults <- the job files it extends <- the job file <- overrides, then validate."""
    config = Config()
    for table, source in _read_job_file(Path(path)) if path else ():
        _apply(config, table, source)
    tables = [_parse_override(arg) for arg in overrides]
    # one command line is one source: `--env.args.k=v --env.name=x` keeps k
    names = [t["env"]["name"] for t in tables if "name" in t.get("env", {})]
    if names and names[-1] != config.env.name:
        config.env.args = {}
    for table in tables:
        if "name" in table.get("env", {}):
            config.env.name = table["env"]["name"]  # already checked against args above
        _apply(config, table, "override")
    config.validate()
    return config


def to_toml(config: Config) -> str:
    """The resolved config as TOML text (what the run saves as config.toml); the
    environment's settings are written in full, defaults included, as [env.args]."""
    lines = []
    for f in dataclasses.fields(config):
        lines.append(f"[{f.name}]")
        section = getattr(config, f.name)
        for sf in dataclasses.fields(section):
            if not isinstance(getattr(section, sf.name), dict):
                lines.append(f"{sf.name} = {toml_value(getattr(section, sf.name))}")
        lines.append("")
        if f.name == "env":
            args = config.env_args()
            lines.append("[env.args]")
            for af in dataclasses.fields(args) if args is not None else ():
                if getattr(args, af.name) is None:
                    continue  # TOML has no null: an omitted key keeps its default, None
                lines.append(f"{af.name} = {toml_value(getattr(args, af.name))}")
            lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table; TOML has no null, so None keys are left out
        items = [f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items() if v is not None]
        return "{" + ", ".join(items) + "}"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _toml_key(key: Any) -> str:
    return (
        key
        if isinstance(key, str) and re.fullmatch(r"[A-Za-z0-9_-]+", key)
        else toml_value(str(key))
    )
