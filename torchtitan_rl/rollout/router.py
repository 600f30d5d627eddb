"""Routes GenerateFn calls over several generator replicas: sticky least loaded.

A rollout's turns carry one session id; every turn after the first sticks to the replica
the session was placed on, so that replica's prefix cache already holds the conversation
so far. A new session (or a call without a session id) goes to the replica with the least
outstanding work, in tokens:

    load(replica) = sum over its calls in flight of (len(prompt_ids) + sampling.max_tokens)
                  + sum over its live sessions with no call in flight of their last call's cost

- A call's cost is its prompt plus max_tokens: an upper bound on what it will generate
  (the router cannot know where it stops), and the prompt is prefill and KV cache the
  replica holds while it decodes. Counting calls instead sends a new session to a replica
  that has one 1000-token call rather than to one with two 10-token calls.
- A live session between turns (its env is thinking) will send another turn to the same
  replica soon, with a context at least as long as its last one: it weighs its last call's
  cost. Counting only calls in flight would pile new sessions onto a replica whose
  sessions happen to be between turns, and it then carries the long tail alone.

Ties go to the replica that has served fewest calls (`routed`), then the lowest index, so
placement is deterministic.

A replica whose process died raises `ReplicaDown` from its GenerateFn. The router marks it
down (`on_down` tells its owner, controller/fleet.py, which restarts it), moves the call to
the least loaded replica that is up, and counts it in `rerouted`; sessions stuck to a down
replica are placed afresh at their next turn. A call is safe to repeat: it carries its whole
context and its own seed, and a replica gives a request the same tokens whatever else it
serves (generation/batch_invariant.py). With no replica up, calls wait for one (`set_up`). The Rollouter ends each session when its rollout ends
(`end_session`), so `sessions` holds the live rollouts only, however many steps run ahead
(rollout.max_staleness) or overlap.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import numpy as np

from torchtitan_rl.types import Completion, GenerateFn, SamplingParams

logger = logging.getLogger(__name__)


class ReplicaDown(RuntimeError):
    """Raised by a replica's GenerateFn when its process is gone: the call never ran there
    to the end and may be sent elsewhere."""


def call_cost(prompt_ids: np.ndarray, sampling: SamplingParams | None) -> int:
    """Tokens a call may occupy a replica with: its prompt plus an upper bound on its output."""
    return int(prompt_ids.shape[0]) + (sampling or SamplingParams()).max_tokens


class Router:
    """A GenerateFn over `replicas` (GenerateFns, e.g. one per generator actor)."""

    def __init__(
        self, replicas: Sequence[GenerateFn], on_down: Callable[[int], None] | None = None
    ):
        if not replicas:
            raise ValueError("Router needs at least one replica")
        self.replicas = list(replicas)
        self.on_down = on_down
        """Told the index of a replica that raised ReplicaDown (once per death)."""
        self.down: set[int] = set()
        """Replicas that take no calls (dead, or restarted and not yet given weights)."""
        self.rerouted = 0
        """Calls moved to another replica because theirs went down, since the start."""
        self._any_up = asyncio.Event()
        self._any_up.set()
        self.inflight = [0] * len(replicas)
        """Calls in flight per replica."""
        self.outstanding_tokens = [0] * len(replicas)
        """Cost (`call_cost`) of the calls in flight per replica."""
        self.idle_tokens = [0] * len(replicas)
        """Last call's cost of the live sessions with no call in flight, per replica."""
        self.sessions: dict[str, int] = {}
        """{session id: replica} of the sessions not ended yet."""
        self.routed = [0] * len(replicas)
        """Calls sent per replica since the start."""
        self.routed_tokens = [0] * len(replicas)
        """Cost (`call_cost`) of the calls sent per replica since the start."""
        self._idle_cost: dict[str, int] = {}
        """{session id: its last call's cost} of live sessions with no call in flight."""

    def load(self, index: int) -> int:
        """Outstanding work of a replica in tokens (see the module docstring)."""
        return self.outstanding_tokens[index] + self.idle_tokens[index]

    def pick(self, session_id: str | None) -> int:
        """The replica for a call: its session's, else the least loaded one that is up."""
        if session_id is not None and session_id in self.sessions:
            index = self.sessions[session_id]
            if index not in self.down:
                return index
            self.end_session(session_id)  # its replica went down: placed afresh
        up = [i for i in range(len(self.replicas)) if i not in self.down]
        assert up, "pick needs a replica that is up"
        index = min(up, key=lambda i: (self.load(i), self.routed[i], i))
        if session_id is not None:
            self.sessions[session_id] = index
        return index

    def set_down(self, index: int) -> None:
        """Take no more calls on `index` (its calls in flight fail with ReplicaDown)."""
        self.down.add(index)
        if len(self.down) == len(self.replicas):
            self._any_up.clear()

    def set_up(self, index: int) -> None:
        """`index` takes calls again (a restarted replica that holds the current weights)."""
        self.down.discard(index)
        self._any_up.set()

    def end_session(self, session_id: str) -> None:
        """The session's rollout is over: forget its replica (a later session with the same
        id, e.g. a validation sample's, is placed afresh)."""
        index = self.sessions.pop(session_id, None)
        if index is not None:
            self.idle_tokens[index] -= self._idle_cost.pop(session_id, 0)

    def _start(self, index: int, session_id: str | None, cost: int) -> None:
        self.inflight[index] += 1
        self.outstanding_tokens[index] += cost
        self.routed[index] += 1
        self.routed_tokens[index] += cost
        if session_id is not None:  # no longer between turns: its call counts instead
            self.idle_tokens[index] -= self._idle_cost.pop(session_id, 0)

    def _finish(self, index: int, session_id: str | None, cost: int) -> None:
        self.inflight[index] -= 1
        self.outstanding_tokens[index] -= cost
        if session_id is not None and self.sessions.get(session_id) == index:
            # live and between turns until its next call (or end_session)
            self.idle_tokens[index] += cost - self._idle_cost.get(session_id, 0)
            self._idle_cost[session_id] = cost

    async def __call__(
        self,
        prompt_ids: np.ndarray,
        *,
        request_id: str,
        session_id: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> Completion | None:
        cost = call_cost(prompt_ids, sampling)
        moved = False
        while True:
            while len(self.down) == len(self.replicas):
                await self._any_up.wait()
            index = self.pick(session_id)
            replica = self.replicas[index]
            self._start(index, session_id, cost)
            try:
                return await replica(
                    prompt_ids, request_id=request_id, session_id=session_id, sampling=sampling
                )
            except ReplicaDown:
                # only the replica's current process: a late failure of one already replaced
                # must not take its successor down
                if index not in self.down and self.replicas[index] is replica:
                    self._went_down(index)
                self.rerouted += not moved  # requests, not attempts
                moved = True
            finally:
                self._finish(index, session_id, cost)

    def _went_down(self, index: int) -> None:
        self.set_down(index)
        if self.on_down is not None:
            try:
                self.on_down(index)
            except Exception:  # the owner's trouble must not lose this call
                logger.exception("on_down(%d) failed", index)
