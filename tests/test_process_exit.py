"""A worker process exits without the interpreter's finalization (actors/process_exit.py):
the exit hooks registered before it do not run, its output is flushed, its exit code says
whether it failed (the code given to `sys.exit` included), and its multiprocessing children do not outlive it."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = """
import atexit, multiprocessing, sys, time
atexit.register(lambda: print("finalized"))  # an earlier hook: skipped
# multiprocessing's own exit hook would wait for this child (not a daemon) for a minute
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=False)
child.start()
print(child.pid)
from torchtitan_rl.actors.process_exit import exit_at_stop
exit_at_stop()
exit_at_stop()  # once per process
sys.stdout.write("no newline")  # flushed at exit
if sys.argv[1] == "fail":
    raise RuntimeError("an uncaught error")
if sys.argv[1] == "code":
    import asyncio

    async def main():  # as Monarch's worker ends
        sys.exit(3)

    asyncio.run(main())
"""


@pytest.mark.parametrize("how", ["stop", "fail", "code"])
def test_a_worker_exits_at_once_flushed_with_its_code_and_no_child_left(how):
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, how], cwd=ROOT, capture_output=True, text=True,
        timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == {"stop": 0, "fail": 1, "code": 3}[how], done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "no newline" and "finalized" not in done.stdout
    assert ("an uncaught error" in done.stderr) == (how == "fail")
    child = int(lines[0])
    assert (
        not Path(f"/proc/{child}").exists()
        or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    )
