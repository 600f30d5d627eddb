"""Entry point: parse the config, run the controller, close, summarise.

    CONFIG_FILE=train_configs/alphabet_sort_tiny.toml ./run_train.sh --training.steps=10

A mistake the user can make (config, missing file, lengths, an env that fails to import, a
process that dies) ends with one `error: ...` line and a non-zero exit code; `--debug`
shows the traceback instead. Exit codes: 2 config, 1 run failure, 130 interrupted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import traceback

DEFAULT_CONFIG = "train_configs/alphabet_sort_tiny.toml"


def main(argv: list[str]) -> int:
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(message)s")
    try:
        from torchtitan_rl.config import load_config, to_toml
        from torchtitan_rl.controller.loop import Controller
        from torchtitan_rl.controller.summary import print_summary
    except Exception as e:  # e.g. a user environment module that does not import
        return _fail(e, debug, 1, prefix="importing torchtitan_rl failed: ")
    try:
        config = load_config(os.environ.get("CONFIG_FILE", DEFAULT_CONFIG), argv)
        controller = Controller(config)
    except ValueError as e:  # ConfigError, or a cross-section / file check of the controller
        return _fail(e, debug, 2)
    except Exception as e:  # e.g. a user environment failing to build
        return _fail(e, debug, 1)
    print(to_toml(config))
    t0 = time.perf_counter()
    try:
        asyncio.run(_run(controller))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        return _fail(e, debug, 1)
    print_summary(controller, time.perf_counter() - t0)
    return 0


async def _run(controller) -> None:
    try:
        await controller.run()
    finally:
        await controller.close()


def _fail(error: BaseException, debug: bool, code: int, prefix: str = "") -> int:
    if debug:
        traceback.print_exception(error)
    else:
        hint = "" if code == 2 else " (run with --debug for the traceback)"
        print(f"error: {prefix}{one_line(error)}{hint}", file=sys.stderr)
    return code


def one_line(error: BaseException) -> str:
    """The user-facing line: the remote exception of a failed actor call, the file and
    line of a syntax or import error, the first line of anything else."""
    try:
        from monarch.actor import ActorError

        from torchtitan_rl.config import ConfigError
        from torchtitan_rl.controller.supervision import ActorFailure
    except Exception:  # the import itself is what failed
        ActorError = ConfigError = ActorFailure = ()  # noqa: N806
    if isinstance(error, ActorError):
        error = error.exception
    if isinstance(error, (ConfigError, ActorFailure)):
        return str(error).splitlines()[0]
    text = (str(error).strip().splitlines() or [""])[0]
    where = ""
    if isinstance(error, SyntaxError) and error.filename:
        where = f" ({error.filename}, line {error.lineno})"
    elif isinstance(error, ImportError) and error.__traceback__ is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        where = f" ({frame.filename}, line {frame.lineno})"
    return f"{type(error).__name__}: {text}{where}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
