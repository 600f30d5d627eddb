"""`--help`: every section's keys with type, value in effect and docstring."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from torchtitan_rl.config.loader import Config, ConfigError, toml_value


def _field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring}: the string literal under each annotated field in the source
    (Python keeps no attribute docstrings at runtime)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _describe_section(name: str, section: Any) -> list[str]:
    import textwrap

    docs = _field_docs(type(section))
    hints = typing.get_type_hints(type(section))
    lines = [f"[{name}]"]
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, dict):
            continue  # [env.args] is described on its own
        hint = hints[f.name]
        if typing.get_origin(hint) is typing.Literal:
            kind = " | ".join(toml_value(c) for c in typing.get_args(hint))
        else:
            kind = getattr(hint, "__name__", str(hint))
        head = f"  {name}.{f.name} ({kind}) = {toml_value(value)}"
        # a long default (a list) continues on indented lines, split after its commas
        lines.extend(textwrap.wrap(head, 100, subsequent_indent="        ", break_on_hyphens=False))
        for text in textwrap.wrap(docs.get(f.name, ""), 88, break_on_hyphens=False):
            lines.append(f"      {text}")
    return lines


def help_text(config: Config) -> str:
    """Usage, then every section's keys with type, value (the defaults, or the config file
    and overrides given) and docstring."""
    lines = [
        "usage: ./run_train.sh [--section.key=value ...] [--env.args.key=value ...]",
        "       [--debug] [--print-config] [--help]",
        "",
        "CONFIG_FILE picks the job file (default: train_configs/alphabet_sort_tiny.toml in",
        "this repository); every key below can be overridden on the command line. Values",
        "shown are the ones in effect: the defaults, then CONFIG_FILE, then the overrides.",
        "--debug shows tracebacks; --print-config prints the resolved config and exits.",
        'A job file may start with `extends = "<file>"` (looked up next to it, then in',
        "train_configs/): it starts from that file, and its own sections override it.",
        "",
    ]
    for f in dataclasses.fields(config):
        lines += _describe_section(f.name, getattr(config, f.name))
        if f.name == "env":
            try:
                args = config.env_args()
            except ConfigError:
                args = None
            lines.append("")
            lines.append(f"[env.args]  (settings of environment {config.env.name!r})")
            if args is not None:
                lines += _describe_section("env.args", args)[1:]
        lines.append("")
    return "\n".join(lines)
