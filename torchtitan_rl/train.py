"""Entry point: parse the config, run the controller, close, summarise.

    CONFIG_FILE=train_configs/alphabet_sort_tiny.toml ./run_train.sh --training.steps=10

A mistake the user can make (config, missing file, lengths, an env that fails to import, a
process that dies) ends with one `error: ...` line and a non-zero exit code; `--debug`
shows the traceback instead. Exit codes: 2 config, 1 run failure, 130 interrupted (Ctrl-C),
143 terminated (SIGTERM: `kill`, `docker stop`, a scheduler's preemption). Both stops close
every process and say whether the same command resumes; the step in progress is not saved
(resume continues from the latest checkpoint, `checkpoint.interval`).
`--help` lists every key with its default and docstring; `--print-config` prints the
resolved config and exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "train_configs" / "alphabet_sort_tiny.toml"
"""The repository's default job, found wherever the command runs from."""
FLAGS = ("--debug", "--help", "-h", "--print-config")


def main(argv: list[str]) -> int:
    flags = {a for a in argv if a in FLAGS}
    argv = [a for a in argv if a not in FLAGS]
    debug = "--debug" in flags
    _setup_logging(debug)
    try:
        from torchtitan_rl.config import load_config, to_toml
    except Exception as e:  # e.g. a dependency that does not import
        if _missing_dependency(e) and not debug:
            print(
                f"error: {e.name!r} is not installed for {sys.executable}: run from the "
                "environment you installed torchtitan_rl into (pip install -e .)",
                file=sys.stderr,
            )
            return 1
        return _fail(e, debug, 1, prefix="importing torchtitan_rl failed: ")
    config_file = os.environ.get("CONFIG_FILE") or DEFAULT_CONFIG
    if flags & {"--help", "-h"}:
        return _print_help(config_file, argv)
    try:
        config = load_config(config_file, argv)
        if "--print-config" in flags:
            return _page(to_toml(config))
    except ValueError as e:  # ConfigError: the job file or an override
        return _fail(e, debug, 2)
    except Exception as e:  # e.g. a user environment module that does not import
        return _fail(e, debug, 1)
    return _train(config, debug)


def _missing_dependency(error: BaseException) -> bool:
    """A package torchtitan_rl needs is absent (most often: the wrong Python is on PATH)."""
    name = getattr(error, "name", None) or ""
    return isinstance(error, ModuleNotFoundError) and name.split(".")[0] != "torchtitan_rl"


def _print_help(config_file: str | Path, overrides: list[str]) -> int:
    """Help must answer even for a job that does not load (that is when it is wanted most):
    it then lists the defaults and the default environment's settings, and says why."""
    from torchtitan_rl.config import Config, help_text, load_config

    try:
        config = load_config(config_file, overrides)
    except Exception as e:  # a ConfigError, or a user environment that fails to import
        note = f"note: {config_file} did not load ({one_line(e)}); showing the defaults"
        print(note, file=sys.stderr)
        config = Config()
    return _page(help_text(config))


def _page(text: str) -> int:
    """Print `text` for a reader that may stop early (`--help | head`, a pager that quits):
    a closed pipe ends the answer quietly, with exit code 0, not a traceback."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # Python would complain again when it flushes at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _train(config, debug: bool) -> int:
    """Spawn and run the job; imported only here, so --help and --print-config stay light."""
    try:
        from torchtitan_rl.controller.loop import Controller
        from torchtitan_rl.controller.summary import print_summary
    except Exception as e:
        return _fail(e, debug, 1, prefix="importing torchtitan_rl failed: ")
    try:
        from torchtitan_rl.controller.preflight import check_machine

        check_machine(config)  # GPUs, cores, sbatch, the output folder
        controller = Controller(config)
        done = controller.folder.completed_step()
        if done >= controller.config.training.last_step:
            print(f"already complete: {controller.run_dir} holds the checkpoint of RL step {done}")
            return 0
        controller.folder.check_resume()
    except ValueError as e:  # a cross-section / file check of the controller
        return _fail(e, debug, 2)
    except Exception as e:  # e.g. a user environment failing to build
        return _fail(e, debug, 1)
    print(f"config   {controller.run_dir / 'config.toml'} (--print-config shows it)")
    t0 = time.perf_counter()
    terminated = []
    try:
        asyncio.run(_run(controller, terminated))
    except KeyboardInterrupt:
        print(f"interrupted: {_resume_hint(controller)}", file=sys.stderr)
        return 130
    except asyncio.CancelledError:
        if not terminated:
            raise
        print(f"terminated (SIGTERM): {_resume_hint(controller)}", file=sys.stderr)
        return 143
    except Exception as e:
        return _fail(e, debug, 1)
    print_summary(controller.metrics, controller.run_dir, time.perf_counter() - t0)
    return 0


def _resume_hint(controller) -> str:
    step = controller.folder.completed_step()
    if step:
        return f"the same command resumes after RL step {step} (the latest checkpoint)"
    every = controller.config.checkpoint.interval
    return f"no checkpoint yet (checkpoint.interval={every}), so the same command starts over"


class _AboveProgressBars(logging.Handler):
    """Log lines written through tqdm, so they land above a progress bar, not glued to it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


def _setup_logging(debug: bool) -> None:
    """The package's log lines through tqdm, on a logger of its own: Monarch reconfigures the
    root logger when it spawns processes, and its lines would be glued to the bar."""
    handler = _AboveProgressBars()
    handler.setFormatter(logging.Formatter("%(message)s"))
    package = logging.getLogger("torchtitan_rl")
    package.handlers[:] = [handler]
    package.propagate = False
    package.setLevel(logging.INFO if debug else logging.WARNING)


async def _run(controller, terminated: list) -> None:
    """Run, then close; SIGTERM cancels the run like Ctrl-C does (and is noted in
    `terminated`), so the processes are closed either way."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()

    def on_sigterm():
        terminated.append(signal.SIGTERM)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        await controller.run()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        await controller.close()


def _fail(error: BaseException, debug: bool, code: int, prefix: str = "") -> int:
    if debug:
        traceback.print_exception(error)
    else:
        plain = code == 2 or getattr(error, "needs_no_traceback", False)
        hint = "" if plain else " (run with --debug for the traceback)"
        print(f"error: {prefix}{one_line(error)}{hint}", file=sys.stderr)
    return code


def one_line(error: BaseException) -> str:
    """The user-facing line: the remote exception of a failed actor call, the file and
    line of a syntax or import error, the first line of anything else."""
    try:
        from monarch.actor import ActorError

        from torchtitan_rl.config import ConfigError
        from torchtitan_rl.controller.run_lock import RunFolderBusy
        from torchtitan_rl.controller.supervision import ActorFailure
    except Exception:  # the import itself is what failed
        ActorError = ConfigError = ActorFailure = RunFolderBusy = ()  # noqa: N806
    if isinstance(error, ActorError):
        error = error.exception
    plain = getattr(error, "needs_no_traceback", False)  # its message is the whole line
    if plain or isinstance(error, (ConfigError, ActorFailure, RunFolderBusy)):
        return str(error).splitlines()[0]
    text = (str(error).strip().splitlines() or [""])[0]
    where = ""
    if isinstance(error, SyntaxError) and error.filename:
        where = f" ({error.filename}, line {error.lineno})"
    elif isinstance(error, ImportError) and error.__traceback__ is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        where = f" ({frame.filename}, line {frame.lineno})"
    return f"{type(error).__name__}: {text}{where}"


def leave(code: int) -> None:
    """Exit with `code` once our output is flushed, without running the interpreter's exit
    hooks: Monarch's (`shutdown_context(host_timeout=0.3).get(timeout=1.0)`, then the Tokio
    runtime's) would shut the client mesh down again after `Controller.close` did, and when
    that takes longer than its second (a loaded machine) it prints a `TimeoutError`
    traceback and aborts the process (exit -6) after our last line was printed. Every file
    the run writes is closed by `Controller.close` before `main` returns."""
    from torchtitan_rl.actors.process_exit import flush_output

    flush_output()
    os._exit(code)


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
