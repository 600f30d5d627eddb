"""Entry point: parse the config, run the controller, close, summarise.

    CONFIG_FILE=train_configs/alphabet_sort_tiny.toml ./run_train.sh --training.steps=10
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

DEFAULT_CONFIG = "train_configs/alphabet_sort_tiny.toml"


def main(argv: list[str]) -> int:
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(message)s")
    try:
        from torchtitan_rl.config import ConfigError, load_config, to_toml

        config = load_config(os.environ.get("CONFIG_FILE", DEFAULT_CONFIG), argv)
    except ConfigError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(to_toml(config))
    from torchtitan_rl.controller import Controller
    from torchtitan_rl.summary import print_summary

    controller = Controller(config)
    t0 = time.perf_counter()
    try:
        asyncio.run(_run(controller))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        print(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        return 1
    print_summary(controller, time.perf_counter() - t0)
    return 0


async def _run(controller) -> None:
    try:
        await controller.run()
    finally:
        await controller.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
