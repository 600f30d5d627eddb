"""verifiers environments by name: `[env] name = "verifiers:<taskset id>"`.

<taskset id> is what verifiers' `vf-eval` takes: an installed verifiers 0.4.0 environment (a
module exporting a `verifiers.v1.Taskset`, and optionally its own `Env`), e.g.
"verifiers:gsm8k-v1" imports `gsm8k_v1`. Its episodes run unmodified in this process with our
generator behind them (envs/verifiers_env.py says how). verifiers is imported only when such a
name is resolved (`pip install 'torchtitan_rl[verifiers]'`).
"""

from __future__ import annotations

import importlib.util
from functools import cache

from torchtitan_rl.envs.base import Environment

HUB = "verifiers"


@cache
def verifiers_environment(taskset_id: str) -> type[Environment]:
    """The Environment class of one verifiers taskset (one class per id, so its
    `config_class` is the same object every time it is resolved)."""
    name = f"{HUB}:{taskset_id}"
    if not taskset_id:
        raise ValueError(
            f"env.name={name!r} names no verifiers environment; write "
            "'verifiers:<taskset id>' (the id vf-eval takes, e.g. 'verifiers:gsm8k-v1')"
        )
    if importlib.util.find_spec("verifiers") is None:
        raise ValueError(
            f"env.name={name!r} needs verifiers, which is not installed: "
            "pip install 'torchtitan_rl[verifiers]' (verifiers==0.4.0)"
        )
    from verifiers.v1.utils.loaders import taskset_class

    from torchtitan_rl.envs.verifiers_env import VerifiersArgs, VerifiersEnvironment

    try:
        taskset_class(taskset_id)
    except (ImportError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"env.name={name!r}: {_first_line(e)}") from e
    attrs = {"taskset_id": taskset_id}
    args = type(f"VerifiersArgs[{taskset_id}]", (VerifiersArgs,), attrs)
    return type(
        f"Verifiers[{taskset_id}]", (VerifiersEnvironment,), {**attrs, "config_class": args}
    )


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
