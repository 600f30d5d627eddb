"""The GenerateFn over one generator replica's actor, as a router calls it (the
controller's, controller/fleet.py, or a rollout process's, actors/rollout.py).

    fn = ActorGenerateFn(actor, "generator1", failover=True)
    await fn(prompt_ids, request_id="3/0/1/0", session_id="3/0/1")  # a Completion
    fn.fail_in_flight()   # its process died: every call waiting on it raises ReplicaDown

With `failover` (a fleet that survives a replica's death, controller/fleet.py) a call whose
process died raises `ReplicaDown`, and the router sends it to another replica. Without it,
the call returns None and the Supervisor ends the run with one line naming the process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError

from torchtitan_rl.rollout.router import ReplicaDown
from torchtitan_rl.types import SamplingParams, ids_to_wire

logger = logging.getLogger(__name__)


def is_death(error: BaseException) -> bool:
    """A process's death as Monarch reports it to a call on it."""
    if isinstance(error, ActorError):
        error = error.exception
    return isinstance(error, SupervisionError)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _as_future(awaitable) -> asyncio.Future:
    """A Monarch call's own asyncio future (`Future.as_asyncio`: no task wraps it); a task
    for another awaitable (the fakes of tests)."""
    as_asyncio = getattr(awaitable, "as_asyncio", None)
    return as_asyncio() if as_asyncio is not None else asyncio.ensure_future(awaitable)


def _wake(waiter: asyncio.Future, _call: asyncio.Future | None) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ActorGenerateFn:
    """GenerateFn over a generator actor. Keeps the calls in flight, so a step that waits too
    long can say what the generator is doing, and a dead replica's calls can be failed."""

    def __init__(self, generator, name: str = "generator", *, failover: bool = False):
        self.generator = generator
        self.name = name
        self.failover = failover
        self.in_flight: dict[str, float] = {}
        """{request_id: when it was sent} of calls not answered yet."""
        self.gone = False
        """The replica's process is known dead: its waiting calls stop waiting."""
        self._waiting: set[asyncio.Future] = set()
        """One future per call waiting for its answer, set when the answer comes or the
        replica is gone. (A task per call waiting on an Event, with asyncio.wait over both,
        cost the controller's loop ~12% of its time at 768 rollouts per step.)"""

    async def __call__(self, prompt_ids, *, request_id, session_id=None, sampling=None):
        sampling = sampling or SamplingParams()
        self.in_flight[request_id] = time.perf_counter()
        try:
            if self.gone:
                raise ReplicaDown(self.name)
            call = _as_future(
                self.generator.generate.call_one(
                    ids_to_wire(prompt_ids), request_id, session_id, sampling
                )
            )
            await self._answer_or_death(call)
            if not call.done():
                call.cancel()
                call.add_done_callback(_retrieve)  # it may still fail, unheard
                raise ReplicaDown(self.name)
            return call.result()
        except ReplicaDown:
            return self._died(request_id)
        except Exception as e:
            if is_death(e) or self.gone:  # a late error of a process known dead
                return self._died(request_id)
            logger.warning("generate %s failed: %s", request_id, e)
            return None  # the call failed: the rollout becomes a generator error
        finally:
            self.in_flight.pop(request_id, None)

    async def _answer_or_death(self, call: asyncio.Future) -> None:
        """Return once `call` is done or the replica is gone, whichever comes first."""
        if call.done():
            return
        waiter = call.get_loop().create_future()
        call.add_done_callback(functools.partial(_wake, waiter))
        self._waiting.add(waiter)
        try:
            await waiter
        except asyncio.CancelledError:  # the caller is gone (its rollout was cancelled):
            call.cancel()  # nobody reads the answer; a failure is not logged as unread
            call.add_done_callback(_retrieve)
            raise
        finally:
            self._waiting.discard(waiter)

    def _died(self, request_id: str) -> None:
        if self.failover:
            raise ReplicaDown(self.name)
        logger.debug("generate %s: %s died", request_id, self.name)
        return None  # the Supervisor ends the run

    def fail_in_flight(self) -> None:
        """The replica's process is gone: its calls in flight (and later ones) raise
        ReplicaDown (with failover) instead of waiting for Monarch to notice."""
        self.gone = True
        for waiter in self._waiting:
            _wake(waiter, None)

    def activity(self) -> str:
        """One phrase: how many requests are in flight and the oldest of them."""
        if self.gone:
            return f"{self.name}: down"
        if not self.in_flight:
            return f"{self.name}: no request in flight"
        oldest = min(self.in_flight, key=self.in_flight.get)
        age = time.perf_counter() - self.in_flight[oldest]
        return (
            f"{self.name}: {len(self.in_flight)} requests in flight, the oldest ({oldest}) "
            f"for {age:.0f} s"
        )
