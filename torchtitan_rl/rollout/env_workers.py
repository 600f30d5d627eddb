"""EnvWorkers: `env.workers` processes that play environment turns and score rollouts.

A turn is played whole in a worker (rollout/env_turn.py): the completion decoded, the env
stepped, its reply encoded, with the worker's own copy of the renderer, so the controller's
event loop only routes generate calls and keeps each rollout's prompt.

Processes, not threads: the scorers that cost milliseconds (a reasoning-gym `score_answer`, a
countdown solver) are pure Python and hold the GIL, so a thread pool leaves their throughput
where the event loop had it, while processes run them in parallel; and a stuck call in a
thread can never be stopped, where a process is killed (docs/benchmarks.md, env steps).

One Pipe per worker; the parent never blocks on one (the event loop reads a pipe when it is
readable):

    parent -> worker   ("open", env) | ("turn", env, Turn) | ("score", rollout) | None (stop)
    worker -> parent   ("ready",) once it loaded the rubric and the renderer, or ("broken",
                       line) if it cannot
                       ("ok", value) | ("timeout", line) | ("raised", error line, traceback)
                       (a turn that ends its rollout answers ("ok", (None, TurnResult)))

A worker runs one call at a time (the next, if small, waits in its pipe: IN_FLIGHT), and the env
travels with each call and comes back stepped, so any worker can take any rollout's next
turn. Calls wait in the parent's FIFO for a worker. A worker bounds `MessageEnv.init` and
`step` by `env.step_timeout_s` itself, as the event loop does, and answers (a turn with its
text, ERROR_TIMEOUT), its process kept. A call stuck where no `await` can end it (a step that
holds its thread, a parse, a scorer) is bounded here: past step_timeout_s + KILL_GRACE_S,
counted from when a worker starts it (waiting for one is not the env's doing), its worker is
killed and replaced and the call raises TimeoutError with a line naming what ran, so it holds
one worker for that long and no other call. A worker that dies during a call: the call raises
EnvCallFailed and a new worker replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import signal
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from torchtitan_rl.rollout.env_calls import (
    EnvCallFailed,
    LocalCalls,
    Opening,
    Score,
    describe_exception,
    run_call,
)
from torchtitan_rl.rollout.env_turn import TurnResult
from torchtitan_rl.types import RolloutStatus

if TYPE_CHECKING:
    from torchtitan_rl.envs.base import MessageEnv, Rubric
    from torchtitan_rl.models.renderer import Renderer
    from torchtitan_rl.rollout.env_turn import Turn
    from torchtitan_rl.types import Rollout

logger = logging.getLogger(__name__)

IN_FLIGHT = 2
"""Calls sent to a worker at once: the next one waits in its pipe, so the worker starts it
without a round trip through the parent (a round trip is ~150 us on an idle CPU and a
scheduler slice on a busy one). It starts only when the one before it ends, and goes back to
the queue if that one is killed."""
PIPELINED_MAX_BYTES = 64 * 1024
"""The largest call sent behind a running one (IN_FLIGHT): the worker reads it only after the
running call, so it must fit in the pipe's buffer (~200 KiB on Linux). A larger one would
block the event loop in its send until then, and forever if the worker's answer does not fit
either (each waits on the other to read); it waits in the queue for an idle worker instead."""
STOP_WAIT_S = 2.0
"""How long `close` waits for an idle worker to exit by itself before killing it."""
KILL_GRACE_S = 1.0
"""How long past env.step_timeout_s a call runs before its worker is killed: time for the
worker to end a step at its own timeout and answer, keeping the turn's text and the process."""
_RAN = {
    "open": "env.init (with the first prompt's encoding)",
    "turn": "the turn (decoding the completion, env.step, encoding its reply)",
    "score": "scoring the rollout",
}
"""What a killed call was running, by its kind, for its error line."""


@dataclass(slots=True)
class _Call:
    call: tuple[Any, ...]
    future: asyncio.Future
    data: bytes | None = None
    """The call pickled, once it was (it may wait again in the queue, or be sent again)."""


@dataclass(slots=True)
class _Worker:
    process: BaseProcess
    conn: Connection
    ready: bool = False
    calls: deque[_Call] = field(default_factory=deque)
    """Sent and not answered, oldest (the one running) first; at most IN_FLIGHT."""
    deadline: float | None = None
    """When `calls[0]` times out (loop time), set when it starts (when the call before it
    ended); None when the worker runs nothing."""


class EnvWorkers:
    """`num_workers` spawned processes behind the `EnvCalls` interface (rollout/env_calls.py).

    The rubric and the renderer are pickled here (ValueError if one cannot be) and loaded
    once per worker; workers start on the first call, on the event loop that makes it, which
    every later call must share. `close` stops them all.
    """

    def __init__(
        self, num_workers: int, rubric: Rubric, renderer: Renderer, *, timeout_s: float
    ) -> None:
        assert num_workers >= 1, num_workers
        self._key = f"env.workers={num_workers}"
        try:
            rubric_bytes = pickle.dumps(rubric)
        except Exception as e:
            raise ValueError(
                f"{self._key} runs the rubric in worker processes, but it cannot be pickled "
                f"({describe_exception(e)}); use module-level reward functions (a lambda or "
                "a local function does not pickle), or env.workers = 0"
            ) from e
        try:
            self._setup_bytes = pickle.dumps((rubric_bytes, renderer))
        except Exception as e:
            raise ValueError(
                f"{self._key} tokenizes each turn in worker processes, but the renderer "
                f"({type(renderer).__name__}) cannot be pickled ({describe_exception(e)}); "
                "or env.workers = 0"
            ) from e
        self._num_workers = num_workers
        self._timeout_s = timeout_s
        self._context = multiprocessing.get_context("spawn")  # fork is unsafe with threads
        self._workers: list[_Worker] = []
        self._queue: deque[_Call] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future | None = None
        """Done once every first worker said ready (or one could not start)."""
        self._watchdog: asyncio.TimerHandle | None = None
        """One timer for every worker's deadline, at or before the earliest: a timer per call
        (armed and cancelled at every call) cost the loop more than the call's IPC."""
        self._closed: str | None = None
        """Why calls are refused: closed, or no worker could start."""

    async def open(self, env: MessageEnv) -> Opening:
        return await self._run(("open", env))

    async def turn(self, env: MessageEnv, turn: Turn) -> tuple[MessageEnv, TurnResult]:
        stepped, result = await self._run(("turn", env, turn))
        return (env if stepped is None else stepped), result  # None: the rollout ended

    async def score(self, rollout: Rollout) -> Score:
        return await self._run(("score", rollout))

    async def _run(self, call: tuple[Any, ...]) -> Any:
        if self._closed is not None:
            raise RuntimeError(self._closed)
        if self._started is None:
            self._loop = asyncio.get_running_loop()
            self._started = self._loop.create_future()
            self._workers = [self._spawn() for _ in range(self._num_workers)]
        assert asyncio.get_running_loop() is self._loop, "EnvWorkers serves one event loop"
        await asyncio.shield(self._started)
        future = self._loop.create_future()
        self._queue.append(_Call(call, future))
        self._dispatch()
        return await future

    def _spawn(self) -> _Worker:
        assert self._loop is not None
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=serve,
            args=(child, self._setup_bytes, self._timeout_s),
            name="env-worker",
            daemon=True,
        )
        process.start()
        child.close()
        worker = _Worker(process=process, conn=parent)
        self._loop.add_reader(parent.fileno(), self._on_message, worker)
        return worker

    def _dispatch(self) -> None:
        """Give queued calls to workers, oldest first, idle workers before busy ones."""
        for depth in range(IN_FLIGHT):
            for worker in self._workers:
                if worker.ready and len(worker.calls) == depth:
                    self._send_one(worker)

    def _send_one(self, worker: _Worker) -> None:
        assert self._loop is not None
        while self._queue:
            call = self._queue.popleft()
            if call.future.done():  # its rollout was cancelled while it waited
                continue
            try:
                # pickled whole before anything is written; not by Connection.send, whose
                # ForkingPickler copies the copyreg table on every call
                if call.data is None:
                    call.data = pickle.dumps(call.call, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                what = "the rollout" if call.call[0] == "score" else type(call.call[1]).__name__
                call.future.set_exception(
                    EnvCallFailed(
                        f"{self._key} sends {what} to a worker process, but it cannot be "
                        f"pickled ({describe_exception(e)}); env.workers = 0 runs it here",
                        traceback.format_exc(),
                    )
                )
                continue
            if worker.calls and len(call.data) > PIPELINED_MAX_BYTES:
                self._queue.appendleft(call)  # for an idle worker, which reads it at once
                return
            try:
                worker.conn.send_bytes(call.data)
            except OSError:  # the worker died; its pipe's EOF replaces it
                self._queue.appendleft(call)
                return
            worker.calls.append(call)
            self._arm(worker)
            return

    def _arm(self, worker: _Worker) -> None:
        """Start the timeout of the worker's running call, if it has one and it is not armed."""
        assert self._loop is not None
        if worker.calls and worker.deadline is None:
            worker.deadline = self._loop.time() + self._timeout_s + KILL_GRACE_S
            if self._watchdog is None:  # else it fires earlier, and then re-arms for this one
                self._watch_at(worker.deadline)

    def _watch_at(self, when: float) -> None:
        assert self._loop is not None
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = self._loop.call_at(when, self._watch, when)

    def _watch(self, when: float) -> None:
        """Expire every call due by `when`; watch for the next deadline, if a call runs."""
        self._watchdog = None
        for worker in list(self._workers):
            if worker.deadline is not None and worker.deadline <= when:
                self._expire(worker)
        deadlines = [w.deadline for w in self._workers if w.deadline is not None]
        if deadlines:
            self._watch_at(min(deadlines))

    def _on_message(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            self._lost(worker)
            return
        assert self._started is not None
        if message[0] == "ready":
            worker.ready = True
            if not self._started.done() and all(w.ready for w in self._workers):
                self._started.set_result(None)
        elif message[0] == "broken":
            self._break(f"{self._key}: {message[1]}")
            return
        else:
            call = worker.calls.popleft()
            worker.deadline = None
            self._arm(worker)
            if not call.future.done():
                _settle(call.future, message)
        self._dispatch()

    def _expire(self, worker: _Worker) -> None:
        """The worker's call ran past env.step_timeout_s + KILL_GRACE_S: kill it, start another."""
        call = self._requeue_behind(worker)
        ran = "a call" if call is None else _RAN[call.call[0]]
        line = (
            f"{ran} ran past env.step_timeout_s={self._timeout_s} (+ {KILL_GRACE_S:g} s grace) "
            f"in an env worker process, which was killed"
        )
        logger.warning("%s (pid %s); a new worker replaces it", line, worker.process.pid)
        self._replace(worker)
        if call is not None and not call.future.done():
            call.future.set_exception(TimeoutError(line))
        self._dispatch()

    def _lost(self, worker: _Worker) -> None:
        """The worker's pipe closed: it exited, which it does only by dying."""
        worker.process.join(timeout=STOP_WAIT_S)
        why = f"an env worker process (pid {worker.process.pid}) died, exit code {worker.process.exitcode}"
        if not worker.ready:  # dying while starting would repeat in every new worker
            self._break(f"{self._key}: {why} before it was ready")
            return
        call = self._requeue_behind(worker)
        logger.warning("%s; a new worker replaces it", why)
        self._replace(worker)
        if call is not None and not call.future.done():
            call.future.set_exception(EnvCallFailed(f"{why} during this call"))
        self._dispatch()

    def _requeue_behind(self, worker: _Worker) -> _Call | None:
        """The worker's running call; the calls sent behind it, never started, go back to
        the front of the queue."""
        running = worker.calls.popleft() if worker.calls else None
        self._queue.extendleft(reversed(worker.calls))
        worker.calls.clear()
        return running

    def _replace(self, worker: _Worker) -> None:
        self._stop(worker, wait_s=0.0)
        self._workers[self._workers.index(worker)] = self._spawn()

    def _break(self, why: str) -> None:
        """No worker can start: the start itself and every call, waiting or running (on the
        workers still up), fail with `why`."""
        error = RuntimeError(why)
        running = [c.future for w in self._workers for c in w.calls]
        for future in [self._started, *(c.future for c in self._queue), *running]:
            if future is not None and not future.done():
                future.set_exception(error)
        self._queue.clear()
        self.close(why)

    def _stop(self, worker: _Worker, *, wait_s: float) -> None:
        """Ask the worker to exit, kill it after `wait_s` (at once when busy), reap it."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(worker.conn.fileno())
        worker.deadline = None
        if wait_s > 0 and not worker.calls and worker.process.is_alive():
            try:
                worker.conn.send(None)
            except OSError:
                pass
            worker.process.join(timeout=wait_s)
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=STOP_WAIT_S)
        worker.conn.close()

    def close(self, why: str = "the env workers are closed") -> None:
        """Stop every worker (an idle one exits, a busy or stuck one is killed) and cancel
        the calls still waiting; nothing is left running. Later calls raise `why`."""
        self._closed = self._closed or why
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        workers, self._workers = self._workers, []
        for worker in workers:
            busy = bool(worker.calls)
            for call in worker.calls:
                call.future.cancel()
            worker.calls.clear()
            self._stop(worker, wait_s=0.0 if busy else STOP_WAIT_S)
        while self._queue:
            self._queue.popleft().future.cancel()


def _settle(future: asyncio.Future, message: tuple[Any, ...]) -> None:
    if message[0] == "ok":
        future.set_result(message[1])
    elif message[0] == "timeout":
        future.set_exception(TimeoutError(message[1]))
    else:
        assert message[0] == "raised", message[0]
        future.set_exception(EnvCallFailed(message[1], message[2]))


def serve(conn: Connection, setup_bytes: bytes, timeout_s: float) -> None:
    """A worker process: load the rubric and the renderer, then answer calls until told to
    stop, bounding each env init and step by `timeout_s`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    try:
        rubric_bytes, renderer = pickle.loads(setup_bytes)
    except Exception as e:
        message = f"a worker process cannot load the renderer: {describe_exception(e)}"
        conn.send(("broken", message))
        return
    try:
        rubric = pickle.loads(rubric_bytes)
    except Exception as e:
        conn.send(("broken", f"a worker process cannot load the rubric: {describe_exception(e)}"))
        return
    calls, loop = LocalCalls(timeout_s, rubric, renderer), asyncio.new_event_loop()
    conn.send(("ready",))
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:  # the controller is gone
            return
        try:
            call = pickle.loads(data)
        except Exception as e:
            message = f"a worker process cannot load the call: {describe_exception(e)}"
            conn.send(("raised", message, traceback.format_exc()))
            continue
        if call is None:
            return
        outcome = _answer(loop, calls, call)
        try:
            data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # the stepped env or its result no longer pickles
            data = pickle.dumps(_unsendable(call, outcome, e, traceback.format_exc()))
        conn.send_bytes(data)


def _unsendable(call: tuple, outcome: tuple, e: Exception, details: str) -> tuple:
    """The answer sent instead of `outcome`, which does not pickle: a turn ends its rollout
    (ERROR_ENV) with its text kept and a line naming what did not pickle; another call
    raises with the line."""
    if call[0] != "turn":
        message = f"the {call[0]} result cannot be sent back: {describe_exception(e)}"
        return ("raised", message, details)
    env, result = outcome[1]  # ("ok", ...): the other answers are strings
    where = f"{type(call[1]).__name__}.step (turn {call[2].index})"
    what = f"the reply or reward_signals of {where}"
    if env is not None and not _pickles(env):
        what = f"the stepped {type(env).__name__} (turn {call[2].index})"
    error = (
        f"{what} cannot be pickled back from its worker process ({describe_exception(e)}); "
        "env.workers = 0 runs it here"
    )
    ended = TurnResult(
        status=RolloutStatus.ERROR_ENV, text=result.text, error=error, error_details=details
    )
    return ("ok", (None, ended))


def _pickles(value: Any) -> bool:
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # any failure to pickle is the answer, not an error here
        return False
    return True


def _answer(loop: asyncio.AbstractEventLoop, calls: LocalCalls, call: tuple) -> tuple:
    try:
        value = loop.run_until_complete(run_call(call, calls))
    except TimeoutError as e:  # env.init past its bound (a turn answers with its TurnResult)
        return ("timeout", str(e))
    except EnvCallFailed as e:
        return ("raised", e.error, e.details)
    if call[0] == "turn" and value[1].status is not None:
        # the rollout ended: its env is not sent back, as nothing steps it again, and a step
        # cut off at its timeout may leave it holding what cannot pickle (a pending task)
        value = (None, value[1])
    return ("ok", value)
