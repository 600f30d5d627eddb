"""Request bookkeeping: waiting queue, running batch, KV blocks, preemption.

No model math and no asyncio here: the engine asks the scheduler to admit, to prepare a
step (a list of `SeqInput`s for the model runner) and to record what a step computed.

Token accounting of one request (prompt P, generated A so far):
    tokens       = P + A
    num_computed = positions whose keys/values are in the cache
    pending      = tokens[num_computed:]   (the next forward feeds these)
After admission `pending` is the uncached part of the prompt (or of P + A after a
preemption); after every forward it is exactly the last sampled token.

Preemption is by recompute: when a running request needs a block and none is free, the
most recently admitted request gives back its blocks and returns to the head of the
queue with what it has generated; on re-admission it prefills P + A (its computed blocks
are usually still in the prefix cache, so that is cheap).

Weight loads: the scheduler counts them (`epoch`) and roots every request's hash chain at
the epoch it was admitted at, so a request admitted after a load never finds blocks
written under older weights (see block_manager.py). A request running across a load keeps
its keys/values (hot swap) and shares no more blocks, since they mix weights; with
`recompute` it re-feeds all its tokens and its blocks are re-hashed under the new epoch,
so later requests may share them once the next forward has rewritten them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from torchtitan_rl.generation.block_manager import BlockManager
from torchtitan_rl.generation.model_runner import SeqInput
from torchtitan_rl.types import SamplingParams


@dataclass(eq=False, slots=True)
class Request:
    """One queued or running request and what it has sampled so far."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    arrival_s: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    support: list[np.ndarray] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    hash_epoch: int = 0
    """Weights epoch `hashes` are rooted at: the scheduler's at admission or recompute."""
    arrival_step: int = 0
    """Engine steps run when the engine took the request in."""
    first_step: int = 0
    """Engine steps run when its first token was recorded (that step included)."""
    admitted_s: float = 0.0
    first_token_s: float = 0.0
    prefix_hit_tokens: int = -1
    """Prompt tokens found in the prefix cache at first admission; -1 before it."""
    num_preemptions: int = 0
    version_min: int | None = None
    version_max: int | None = None
    finished: bool = False
    """Set when the scheduler gives the request's blocks back (`Scheduler.finish`); its
    future is resolved later, on the caller's loop."""
    check_from: int = 0
    """The position (index in the completion) from which every token recorded runs the
    engine's full finish check; before it only a stop token can end the request. The
    engine sets it at enqueue (the last position before a length limit; 0 with stop
    sequences); 0 checks every token."""

    def is_over(self) -> bool:
        """Finished, or given up by its caller."""
        return self.finished or self.future.done()

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def pending(self) -> list[int]:
        """Tokens whose keys/values are not cached yet (see the module docstring)."""
        n_prompt = len(self.prompt_ids)
        if self.num_computed >= n_prompt:
            return self.token_ids[self.num_computed - n_prompt :]
        return self.tokens[self.num_computed :]

    def saw_version(self, version: int) -> None:
        if version == self.version_max and self.version_min is not None:
            return  # the common case, once per token: nothing changes
        self.version_min = version if self.version_min is None else min(self.version_min, version)
        self.version_max = version if self.version_max is None else max(self.version_max, version)


class Scheduler:
    """FIFO admission under a sequence limit and a block budget."""

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.version = 0
        """Policy version of the weights the next forward computes with."""
        self.epoch = 0
        """Weight loads so far: keys the prefix cache, unlike `version` never repeats."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        """In admission order: preemption takes from the end."""

    def admit(
        self,
        now: float,
        max_new_tokens: int | None = None,
        started_only: bool = False,
        long_prefill: int | None = None,
    ) -> list[Request]:
        """Moves queued requests into the running batch while sequences and blocks allow,
        and, with `max_new_tokens`, while the uncached tokens they feed add up to at most
        that (the first one always comes in; one feeding more than `long_prefill` neither
        counts nor waits: its step is not a graph's anyway), and with `started_only` only requests that
        already generated tokens (preempted); stops at the first that does not fit, so
        requests start in arrival order."""
        admitted: list[Request] = []
        bs = self.blocks.block_size
        new_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.future.done():  # the caller gave up while it was queued
                self.waiting.popleft()
                continue
            if started_only and not request.token_ids:
                break
            tokens = request.tokens
            request.hashes = self.blocks.chain_hashes(tokens, [], self.epoch)
            request.hash_epoch = self.epoch
            # At least one token must be fed, to get the next-token logits.
            cached = self.blocks.match(request.hashes, len(tokens) - 1, self.epoch)
            new = self.blocks.blocks_needed(len(tokens)) - len(cached)
            if not self.blocks.can_allocate(cached, new):
                break
            feeds = len(tokens) - len(cached) * bs
            short = long_prefill is None or feeds <= long_prefill
            if short and admitted and max_new_tokens is not None:
                if new_tokens + feeds > max_new_tokens:
                    break
            new_tokens += feeds if short else 0
            self.waiting.popleft()
            request.block_table = self.blocks.allocate(cached, len(tokens))
            self.blocks.register(request.block_table, request.hashes)
            request.num_computed = len(cached) * bs
            if cached:
                request.saw_version(self.version)
            if request.prefix_hit_tokens < 0:
                request.prefix_hit_tokens = request.num_computed
                request.admitted_s = now
            self.running.append(request)
            admitted.append(request)
        return admitted

    def prepare_step(self) -> list[SeqInput]:
        """Reserves blocks for every running request's pending tokens (preempting from
        the most recently admitted when short) and returns the forward's inputs."""
        i, bs = 0, self.blocks.block_size
        while i < len(self.running):
            request = self.running[i]
            num_tokens = len(request.prompt_ids) + len(request.token_ids)
            # Most steps a request's last block still has room: skip the block manager.
            if len(request.block_table) * bs >= num_tokens or self.blocks.grow(
                request.block_table, num_tokens
            ):
                i += 1
                continue
            self.preempt(self.running[-1])
        return [
            SeqInput(
                token_ids=r.pending(),
                start=r.num_computed,
                block_table=list(r.block_table),
            )
            for r in self.running
        ]

    def look_ahead_step(
        self, continuing: list[Request], admitted: list[Request]
    ) -> tuple[list[SeqInput], list[SeqInput]] | None:
        """Inputs of the step after the one just computed for `continuing`, before its
        sampled tokens are known (they stay on the device): each of those rows feeds one
        token at position `num_computed` (reserving that position's block); each request
        `admitted` since feeds its pending tokens (its blocks were allocated at admission).
        None (and the caller steps normally, preempting if it must) when the cache has no
        block to spare."""
        bs = self.blocks.block_size
        for request in continuing:
            needed = request.num_computed + 1
            if len(request.block_table) * bs < needed and not self.blocks.grow(
                request.block_table, needed
            ):
                return None
        decode = [
            SeqInput(token_ids=[0], start=r.num_computed, block_table=r.block_table)
            for r in continuing
        ]
        prefill = [
            SeqInput(token_ids=r.pending(), start=r.num_computed, block_table=list(r.block_table))
            for r in admitted
        ]
        return decode, prefill

    def step_done(self, requests: list[Request]) -> None:
        """Records that a forward wrote every pending token of `requests`; blocks it filled
        become shareable unless their request holds keys/values of older weights."""
        bs = self.blocks.block_size
        for request in requests:
            before = request.num_computed
            request.num_computed = len(request.prompt_ids) + len(request.token_ids)
            if request.num_computed // bs > before // bs:  # a block filled up
                self.blocks.mark_computed(request.block_table, request.num_computed, self.epoch)
                stale = request.hash_epoch != self.epoch  # ran across a load, kept its KV
                if not stale and len(request.hashes) < request.num_computed // bs:
                    request.hashes = self.blocks.chain_hashes(
                        request.tokens[: request.num_computed], request.hashes, self.epoch
                    )
                    self.blocks.register(request.block_table, request.hashes)

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.block_table)
        request.num_computed = 0
        request.hashes = []
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """The request is over (finished or cancelled): its blocks go back."""
        self.running.remove(request)
        self.blocks.free(request.block_table)
        request.finished = True

    def weights_changed(self, version: int, *, recompute: bool) -> None:
        """The next forward computes with new weights (see the module docstring)."""
        self.version = version
        self.epoch += 1
        self.blocks.reset_prefix_cache()
        if recompute:
            self.recompute_running()

    def recompute_running(self) -> None:
        """Makes every running request re-feed all its tokens at the next step, rewriting
        its blocks in place, and hashes them under the current epoch: as at admission,
        until that forward they are shared only with sequences that run in it. All blocks
        are invalidated before any is registered again (siblings share blocks)."""
        for request in self.running:
            self.blocks.invalidate(request.block_table)
        for request in self.running:
            request.num_computed = 0
            request.hashes = self.blocks.chain_hashes(request.tokens, [], self.epoch)
            request.hash_epoch = self.epoch
            self.blocks.register(request.block_table, request.hashes)

    def drop_all(self) -> list[Request]:
        """Empties the queue and the batch (freeing blocks); returns what was there."""
        for request in self.running:
            self.blocks.free(request.block_table)
        dropped = [*self.waiting, *self.running]
        self.waiting.clear()
        self.running.clear()
        return dropped
