"""Which training prompts were handed out, and which go out again.

Prompts are dataset indices (`Environment.train_sample(index)`). A step's batch draws them
round by round (`draw`); indices handed back (`requeue`: a batch that was still in flight
when the run stopped, or a group dropped as too stale) go out again before any fresh one, in
the order they were first drawn, so a resumed run generates the same prompts, in the same
order, as a run that never stopped.

    ledger = PromptLedger(next_fresh=0)
    ledger.draw(step=1, n=3)        # [0, 1, 2]
    ledger.requeue([1])
    ledger.draw(step=2, n=2)        # [1, 3]
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class PromptLedger:
    next_fresh: int = 0
    """The first index never handed out."""
    requeued: list[int] = field(default_factory=list)
    """Indices to hand out again first, in order."""
    handed_out: dict[int, list[int]] = field(default_factory=dict)
    """{step: indices drawn for that step's batch, in draw order} for batches not settled yet
    (`settle` forgets a step once its batch is trained or stored with a checkpoint)."""

    def draw(self, step: int, n: int) -> list[int]:
        """`n` indices for `step`: requeued ones first, then fresh ones."""
        again, self.requeued = self.requeued[:n], self.requeued[n:]
        fresh = list(range(self.next_fresh, self.next_fresh + n - len(again)))
        self.next_fresh += len(fresh)
        indices = again + fresh
        self.handed_out.setdefault(step, []).extend(indices)
        return indices

    def requeue(self, indices: list[int]) -> None:
        """Hand these out again, before anything else still queued (oldest first)."""
        self.requeued = sorted(set(indices) | set(self.requeued))

    def settle(self, step: int) -> list[int]:
        """The step's batch is done with (trained, or kept whole in a checkpoint)."""
        return self.handed_out.pop(step, [])

    def saved(self, keep: set[int]) -> tuple[int, list[int]]:
        """(next_fresh, requeued) for a checkpoint that stores the batches of the steps in
        `keep` whole: the indices of every other unsettled batch go out again on resume."""
        again = {i for step, ids in self.handed_out.items() if step not in keep for i in ids}
        return self.next_fresh, sorted(again | set(self.requeued))
