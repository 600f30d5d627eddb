"""Routes GenerateFn calls over several generator replicas.

A rollout's turns carry one session id; the first turn of a session goes to the
least-loaded replica and every later turn sticks to it, so the replica's prefix cache
already holds the conversation so far. Calls without a session id go least-loaded.
The Rollouter ends each session when its rollout ends (`end_session`), so `sessions` holds
the live rollouts only, however many steps run ahead (rollout.max_staleness) or overlap.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from torchtitan_rl.types import Completion, GenerateFn, SamplingParams


class Router:
    """A GenerateFn over `replicas` (GenerateFns, e.g. one per generator actor)."""

    def __init__(self, replicas: Sequence[GenerateFn]):
        if not replicas:
            raise ValueError("Router needs at least one replica")
        self.replicas = list(replicas)
        self.inflight = [0] * len(replicas)
        self.sessions: dict[str, int] = {}
        """{session id: replica} of the sessions not ended yet."""
        self.routed = [0] * len(replicas)

    def pick(self, session_id: str | None) -> int:
        if session_id is not None and session_id in self.sessions:
            return self.sessions[session_id]
        # least loaded; ties go to the replica that has served fewest calls, then lowest index
        index = min(range(len(self.replicas)), key=lambda i: (self.inflight[i], self.routed[i], i))
        if session_id is not None:
            self.sessions[session_id] = index
        return index

    def end_session(self, session_id: str) -> None:
        """The session's rollout is over: forget its replica (a later session with the same
        id, e.g. a validation sample's, is placed afresh)."""
        self.sessions.pop(session_id, None)

    async def __call__(
        self,
        prompt_ids: np.ndarray,
        *,
        request_id: str,
        session_id: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> Completion | None:
        index = self.pick(session_id)
        self.inflight[index] += 1
        self.routed[index] += 1
        try:
            return await self.replicas[index](
                prompt_ids, request_id=request_id, session_id=session_id, sampling=sampling
            )
        finally:
            self.inflight[index] -= 1
