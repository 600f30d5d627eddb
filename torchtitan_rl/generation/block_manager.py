"""Which KV blocks each sequence owns, and the prefix cache that lets sequences share them.

A block is identified for reuse by the chained hash of the token ids of every full block
up to and including it: `h_i = hash((h_{i-1}, tokens[i * bs : (i + 1) * bs]))`. A prompt
that starts with the same full blocks as an earlier sequence (the next turn of a session,
whose prompt extends the last one; the siblings of a GRPO group) maps to the same hashes
and reuses those blocks instead of recomputing them.

Keys/values depend on the weights that computed them, so a cache never mixes weights: the
chain is rooted at a weights epoch, `h_{-1} = hash(("weights", epoch))`, where the caller
counts weight loads (a counter, not the caller's policy version: version numbers can
repeat with different weights, e.g. a model's build weights and the trainer's first
weights are both version 0). A sequence hashes its blocks under the epoch it was admitted
at, so they can only be found by sequences admitted at that epoch: after a load, none
ever again. Each block also records the epoch of the forward that completed it,
and `match` refuses a computed block whose record differs from the epoch asked for: a
block partly written under old weights and completed under new ones, or written after a
prefix of old keys/values, is never served.

Block life cycle, by reference count:
- in use (ref > 0): listed in at least one running sequence's block table;
- cached (ref == 0, hashed, computed): kept for reuse, evicted least recently freed first;
- free (ref == 0, no hash): handed out first.

A block is registered under its hash when a sequence is admitted (so siblings admitted in
the same step share it) but only counts as computed once a forward has written it
(`mark_computed`). A registered block that was never computed is matched only while it is
in use, i.e. by sequences that run in the same forward as the one writing it, and loses
its hash when freed.
"""

from __future__ import annotations

from collections import OrderedDict, deque


def root_hash(epoch: int) -> int:
    """First link of every hash chain of `epoch` (see the module docstring)."""
    return hash(("weights", epoch))


class BlockManager:
    """Block allocation with reference counts, prefix hashing and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_cache: bool) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._computed = [False] * num_blocks
        self._epoch = [0] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self._free) + len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def chain_hashes(self, token_ids: list[int], start: list[int], epoch: int) -> list[int]:
        """Extends `start` (hashes of the first full blocks, rooted at `epoch`) to every full
        block of `token_ids`."""
        bs = self.block_size
        hashes = list(start)
        parent = hashes[-1] if hashes else root_hash(epoch)
        for i in range(len(hashes), len(token_ids) // bs):
            parent = hash((parent, tuple(token_ids[i * bs : (i + 1) * bs])))
            hashes.append(parent)
        return hashes

    def match(self, hashes: list[int], max_tokens: int, epoch: int) -> list[int]:
        """Blocks holding the longest cached prefix of at most `max_tokens` tokens, all
        computed under `epoch` (`hashes` are rooted at it) or about to be (in use)."""
        if not self.enable_prefix_cache:
            return []
        blocks: list[int] = []
        for h in hashes[: max_tokens // self.block_size]:
            block = self._by_hash.get(h)
            if block is None:
                break
            if self._computed[block]:
                if self._epoch[block] != epoch:
                    break  # completed under other weights than its chain's
            elif self._ref[block] == 0:
                break  # never written and no longer being written
            blocks.append(block)
        return blocks

    def can_allocate(self, cached: list[int], num_new_blocks: int) -> bool:
        reclaimed = sum(1 for b in cached if self._ref[b] == 0)
        return num_new_blocks <= self.num_free - reclaimed

    def allocate(self, cached: list[int], num_tokens: int) -> list[int]:
        """A block table for `num_tokens` tokens whose first blocks are `cached`."""
        for block in cached:
            if self._ref[block] == 0:
                del self._cached[block]
            self._ref[block] += 1
        table = list(cached)
        self.grow(table, num_tokens)
        return table

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Appends blocks until `table` holds `num_tokens` tokens; False (unchanged) when
        there are not enough blocks."""
        need = self.blocks_needed(num_tokens) - len(table)
        if need > self.num_free:
            return False
        for _ in range(need):
            table.append(self._take())
        return True

    def register(self, table: list[int], hashes: list[int]) -> None:
        """Makes the full blocks of `table` findable under `hashes` (first come keeps a hash)."""
        if not self.enable_prefix_cache:
            return
        for block, h in zip(table, hashes):
            if self._hash[block] is None and h not in self._by_hash:
                self._hash[block] = h
                self._by_hash[h] = block

    def mark_computed(self, table: list[int], num_tokens: int, epoch: int) -> None:
        """Records that the first `num_tokens` positions of `table` now hold keys/values
        and that the forward completing a block ran under `epoch` (only whole blocks count)."""
        for block in table[: num_tokens // self.block_size]:
            if not self._computed[block]:
                self._computed[block] = True
                self._epoch[block] = epoch

    def free(self, table: list[int]) -> None:
        """Drops one reference to each block; tail blocks are evicted before head blocks."""
        for block in reversed(table):
            self._ref[block] -= 1
            assert self._ref[block] >= 0, block
            if self._ref[block] > 0:
                continue
            if self._hash[block] is not None and self._computed[block]:
                self._cached[block] = None
            else:
                self._unhash(block)
                self._free.append(block)
        table.clear()

    def reset_prefix_cache(self) -> None:
        """Forgets every hash: cached blocks become free, blocks in use are no longer shared
        with new sequences. After a weight load no hashed block can match again (its chain
        has an older root), so this changes no result; it hands those blocks out before
        matchable cached ones instead of letting them age through the LRU order."""
        for block in self._by_hash.values():
            self._hash[block] = None
        self._by_hash.clear()
        self._free.extend(self._cached)
        self._cached.clear()

    def invalidate(self, table: list[int]) -> None:
        """Marks a table's blocks as not computed and forgets their hashes: their keys/values
        are about to be rewritten, and the caller may register them again."""
        for block in table:
            self._computed[block] = False
            self._unhash(block)

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached.popitem(last=False)
            self._unhash(block)
        self._ref[block] = 1
        self._computed[block] = False
        return block

    def _unhash(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            del self._by_hash[h]
            self._hash[block] = None
