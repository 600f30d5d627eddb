"""The asyncio front both engines share: submit, queue, weights, close, and the loop that
steps the engine.

`generate` validates a request, hands it to the engine and awaits its future. The engine is
stepped by one of two drivers:

- threaded (the default, what the generator actor runs): the engine core runs on a thread
  of its own. Before every engine step it takes what arrived (requests, weights) and admits
  it, so a turn that reaches the generator process joins the next step: the caller's event
  loop (Monarch's message hand-over, other endpoints) never waits for engine steps, and
  engine steps never wait for the event loop. Finished requests are handed back with
  `call_soon_threadsafe`.
- inline (`threaded=False`): one asyncio task on the caller's loop repeats

      pull weights -> admit -> up to `steps_per_yield` engine steps -> yield to the loop

  Nothing on the loop interleaves with an engine step, so tests can place a weight load
  between two given steps.

Either way one pass is: pull weights (hot swap: now; drain: once nothing runs), admit
(queue -> batch), engine steps. Each engine supplies the verbs (`_enqueue`, `_pull_weights`,
`_admit`, `_steps`, ...); neither engine imports the other. An engine resolves a request
with `_complete(future, completion)`, never `future.set_result`, so it is safe from the
engine thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping

import numpy as np
import torch

from torchtitan_rl.generation.interface import EngineConfig, error_completion, request_error
from torchtitan_rl.types import Completion, SamplingParams

Weights = tuple[Mapping[str, torch.Tensor], int, bool]
"""(state in torchtitan names, policy version, partial) as queued by `load_weights`."""


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():  # the caller may have given up meanwhile
        future.set_result(result)


def _fail(future: asyncio.Future, message: str) -> None:
    if not future.done():
        future.set_exception(RuntimeError(message))


class EngineFront:
    """The asyncio front of an engine (module docstring). Call the public methods from one
    event loop thread.

    An engine subclasses it and implements:
    - `_enqueue(request_id, prompt_ids, sampling, future, arrival_s)`: queue a valid
      request (`arrival_s`: `time.perf_counter()` when `generate` was called);
    - `_has_waiting()` / `_has_running()`: requests queued / in the running batch;
    - `_pull_weights(pending)`: apply `pending` (oldest first) and set `self._version`;
      called between engine steps, never inside one;
    - `_may_admit()`: False while queued requests must wait (vLLM: a pending cache reset);
    - `_admit(started_only)`, `_steps(num_steps)`: queue -> running batch (`started_only`:
      only requests preempted back to the queue); up to num_steps engine steps;
    - `_has_started()`: running or preempted requests (default: `_has_running()`);
    - `_drop_all()`: forget every request, returning their futures;
    - `_shutdown()`: release the engine once the loop has stopped.
    """

    def __init__(
        self, config: EngineConfig, *, threaded: bool = True, steps_per_yield: int = 8
    ) -> None:
        """`threaded`: the driver (module docstring). `steps_per_yield`: engine steps
        between yields of the inline driver (the threaded one looks for new requests and
        weights before every step)."""
        config.validate()
        if steps_per_yield < 1:
            raise ValueError(f"steps_per_yield must be >= 1, got {steps_per_yield}")
        self.config = config
        self.vocab_size = 0
        """Set by the engine: prompts must hold ids below it."""
        self._version = 0
        self._threaded = threaded
        self._steps_per_yield = steps_per_yield
        self._closed = False
        self._lock = threading.Lock()
        """Guards `_pending_weights`, `_inbox` and `_stop` (shared with the engine thread)."""
        self._pending_weights: list[Weights] = []
        self._inbox: list[tuple[str, list[int], SamplingParams, asyncio.Future, float]] = []
        """Threaded: requests handed over, not yet seen by the engine thread."""
        self._stop = False
        self._wake = threading.Event() if threaded else asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        """The callers' event loop (futures belong to it)."""
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        """Why the engine thread stopped, if it failed."""
        self.loop_seconds = {"busy_s": 0.0, "pull_s": 0.0}
        """Seconds since start the driver spent in passes (pull, admit, steps), and in weight
        pulls alone (the rest of the time it waits for work)."""

    @property
    def policy_version(self) -> int:
        """Version of the weights the engine computes with now."""
        return self._version

    async def generate(
        self,
        prompt_ids: np.ndarray,
        *,
        request_id: str,
        session_id: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> Completion:
        """Generates one completion. An invalid request comes back as an ERROR completion.

        `session_id` needs no special handling: a turn that extends an earlier turn's
        tokens finds them in the prefix cache by hash. Raises RuntimeError("engine
        closed") if the engine is or gets closed.
        """
        if self._closed:
            raise RuntimeError("engine closed")
        sampling = sampling if sampling is not None else SamplingParams()
        error = request_error(prompt_ids, sampling, self.config.max_seq_len, self.vocab_size)
        if error is not None:
            return error_completion(request_id, error, self._version)
        self._ensure_driver()
        future = asyncio.get_running_loop().create_future()
        prompt = np.asarray(prompt_ids).astype(np.int64).tolist()
        if self._threaded:
            with self._lock:  # the thread may have failed since `_ensure_driver`
                if self._error is not None:
                    raise RuntimeError("engine loop stopped") from self._error
                self._inbox.append((request_id, prompt, sampling, future, time.perf_counter()))
        else:
            self._enqueue(request_id, prompt, sampling, future, time.perf_counter())
        self._wake.set()
        return await future

    def load_weights(
        self, state: Mapping[str, torch.Tensor], version: int, *, partial: bool = False
    ) -> None:
        """Queues new weights (torchtitan names, full tensors); they are pulled in between
        engine steps (see `EngineConfig.weight_sync_mode`), or now if nothing has started
        the engine yet. The engine keeps references to the tensors until they are applied,
        so do not modify them in the meantime. `partial`: `state` holds only the weights
        that changed (an adapter-only sync's merges); the others keep their values. A
        partial load is a weight load like any other: a new version, a new KV epoch."""
        if self._closed:
            raise RuntimeError("engine closed")
        if self._task is None and self._thread is None:
            self._pull_weights([(state, version, partial)])
            return
        with self._lock:
            self._pending_weights.append((state, version, partial))
        self._wake.set()

    async def close(self) -> None:
        """Fails every outstanding request with RuntimeError("engine closed"), stops the
        driver, releases the engine."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            with self._lock:
                self._stop = True
            self._wake.set()
            await asyncio.to_thread(self._thread.join)
        self._fail_all("engine closed")
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._shutdown()

    def _complete(self, future: asyncio.Future, completion: Completion) -> None:
        """Resolves a request's future from whichever thread steps the engine."""
        if self._threaded:
            self._loop.call_soon_threadsafe(_resolve, future, completion)
        else:
            _resolve(future, completion)

    def _ensure_driver(self) -> None:
        if self._error is not None or (self._task is not None and self._task.done()):
            raise RuntimeError("engine loop stopped") from self._error
        if self._task is not None or self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        if not self._threaded:
            self._task = self._loop.create_task(self._inline_loop())
            return
        # the engine thread computes on the GPU this (the caller's) thread has selected, with
        # its CPU threads (OpenMP's count is per thread: vLLM's CPU attention checks it)
        cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._thread = threading.Thread(
            target=self._thread_loop,
            args=(cuda, torch.get_num_threads()),
            name="engine",
            daemon=True,
        )
        self._thread.start()

    async def _inline_loop(self) -> None:
        try:
            while True:
                if not self._has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._iteration(self._steps_per_yield)
                await asyncio.sleep(0)
        except Exception as exc:
            self._fail_all(f"engine loop failed: {exc!r}")
            raise

    def _thread_loop(self, cuda: int | None, cpu_threads: int) -> None:
        torch.set_num_threads(cpu_threads)
        if cuda is not None:
            torch.cuda.set_device(cuda)
        try:
            while True:
                with self._lock:
                    if self._stop:
                        return
                    arrived, self._inbox = self._inbox, []
                for request in arrived:
                    self._enqueue(*request)
                if not self._has_work():
                    self._wake.wait()
                    self._wake.clear()  # what set it is looked at on the next pass
                    continue
                self._iteration(1)
        except Exception as exc:  # fail every caller, from their loop; later calls raise
            with self._lock:  # `generate` checks it under the lock before queueing
                self._error = exc
            message = f"engine loop failed: {exc!r}"
            for future in self._take_all():
                self._loop.call_soon_threadsafe(_fail, future, message)

    def _has_work(self) -> bool:
        return self._has_waiting() or self._has_running() or bool(self._pending_weights)

    def _iteration(self, num_steps: int) -> None:
        t0 = time.perf_counter()
        try:
            self._pass(num_steps, t0)
        finally:
            self.loop_seconds["busy_s"] += time.perf_counter() - t0

    def _pass(self, num_steps: int, t0: float) -> None:
        drain = self.config.weight_sync_mode == "drain"
        # drain: a request preempted back to the queue holds tokens of the old weights too
        if self._pending_weights and not (drain and self._has_started()):
            with self._lock:
                pending, self._pending_weights = self._pending_weights, []
            self._pull_weights(pending)
            self.loop_seconds["pull_s"] += time.perf_counter() - t0
        if self._has_waiting() and self._may_admit():
            if not (drain and self._pending_weights):
                self._admit()
            else:  # draining: only what already started under the old weights comes back
                self._admit(started_only=True)
        if self._has_running():
            self._steps(num_steps)

    def _take_all(self) -> list[asyncio.Future]:
        """The futures of every request the engine or the inbox holds, which both forget;
        the driver must be stopped (or be the caller)."""
        with self._lock:
            futures = [*self._drop_all(), *(r[3] for r in self._inbox)]
            self._inbox.clear()
        return futures

    def _fail_all(self, message: str) -> None:
        for future in self._take_all():
            _fail(future, message)

    # ---- what each engine implements ---------------------------------------------------
    def _enqueue(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        future: asyncio.Future,
        arrival_s: float,
    ) -> None:
        raise NotImplementedError

    def _has_waiting(self) -> bool:
        raise NotImplementedError

    def _has_running(self) -> bool:
        raise NotImplementedError

    def _has_started(self) -> bool:
        """Running, or queued again with tokens already generated (preempted)."""
        return self._has_running()

    def _pull_weights(self, pending: list[Weights]) -> None:
        raise NotImplementedError

    def _may_admit(self) -> bool:
        return True

    def _admit(self, started_only: bool = False) -> None:
        """`started_only`: admit only requests that already generated tokens."""
        raise NotImplementedError

    def _steps(self, num_steps: int) -> None:
        raise NotImplementedError

    def _drop_all(self) -> list[asyncio.Future]:
        raise NotImplementedError

    def _shutdown(self) -> None:
        """Nothing to release by default."""
