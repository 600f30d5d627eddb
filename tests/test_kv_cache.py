from torchtitan_rl.generation.block_manager import BlockManager


def manager(num_blocks=8, block_size=4, prefix=True) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_cache=prefix)


def test_allocate_and_free_return_blocks_to_the_pool():
    bm = manager()
    table = bm.allocate([], 9)  # 9 tokens -> 3 blocks
    assert len(table) == 3 and bm.num_free == 5
    assert bm.grow(table, 12) and len(table) == 3
    assert bm.grow(table, 13) and len(table) == 4
    assert not bm.grow(table, 100) and len(table) == 4
    bm.free(table)
    assert table == [] and bm.num_free == 8


def test_computed_full_blocks_are_found_by_a_prompt_that_extends_them():
    bm = manager()
    first = list(range(10))
    table = bm.allocate([], len(first))
    bm.register(table, bm.chain_hashes(first, [], 3))
    bm.mark_computed(table, len(first), epoch=3)
    bm.free(table)
    assert bm.num_free == 8  # cached blocks still count as available
    longer = first + [50, 51, 52]
    assert len(bm.match(bm.chain_hashes(longer, [], 3), len(longer) - 1, 3)) == 2
    other = [99] + first[1:]
    assert bm.match(bm.chain_hashes(other, [], 3), len(other) - 1, 3) == []


def test_match_leaves_at_least_the_tokens_the_caller_asks_for():
    bm = manager()
    tokens = list(range(8))
    table = bm.allocate([], 8)
    bm.register(table, bm.chain_hashes(tokens, [], 0))
    bm.mark_computed(table, 8, epoch=0)
    cached = bm.match(bm.chain_hashes(tokens, [], 0), len(tokens) - 1, 0)
    assert len(cached) == 1  # the last block must be recomputed to get logits


def test_uncomputed_blocks_are_shared_only_while_in_use_and_forgotten_on_free():
    bm = manager()
    tokens = list(range(9))
    hashes = bm.chain_hashes(tokens, [], 0)
    table = bm.allocate([], 9)
    bm.register(table, hashes)
    assert len(bm.match(hashes, 8, 0)) == 2  # same-step sibling may share
    bm.free(table)  # never computed: must not be served later
    assert bm.match(hashes, 8, 0) == []


def test_eviction_reuses_cached_blocks_lru_and_reset_forgets_all():
    bm = manager(num_blocks=4)
    a = list(range(8))
    table = bm.allocate([], 8)
    bm.register(table, bm.chain_hashes(a, [], 0))
    bm.mark_computed(table, 8, epoch=0)
    bm.free(table)
    hashes = bm.chain_hashes(a, [], 0)
    fresh = bm.allocate([], 12)  # 3 blocks: 2 free + the LRU cached (a's tail block)
    assert len(bm.match(hashes, 8, 0)) == 1
    bm.free(fresh)
    bm.reset_prefix_cache()
    assert bm.match(hashes, 8, 0) == [] and bm.num_free == 4


def test_disabled_prefix_cache_never_matches():
    bm = manager(prefix=False)
    tokens = list(range(9))
    table = bm.allocate([], 9)
    bm.register(table, bm.chain_hashes(tokens, [], 0))
    bm.mark_computed(table, 9, epoch=0)
    assert bm.match(bm.chain_hashes(tokens, [], 0), 8, 0) == []


def test_blocks_computed_under_one_weights_epoch_match_only_at_that_epoch():
    bm = manager()
    tokens = list(range(9))
    table = bm.allocate([], 9)
    bm.register(table, bm.chain_hashes(tokens, [], 4))
    bm.mark_computed(table, 9, epoch=4)
    bm.free(table)
    assert len(bm.match(bm.chain_hashes(tokens, [], 4), 8, 4)) == 2
    assert bm.match(bm.chain_hashes(tokens, [], 5), 8, 5) == []


def test_block_completed_under_newer_weights_than_its_chain_is_never_matched():
    """A sequence admitted at epoch 0 whose second block was written partly before and
    partly after a weight load: that block mixes weights, its first block does not."""
    bm = manager()
    tokens = list(range(9))
    hashes = bm.chain_hashes(tokens, [], 0)
    table = bm.allocate([], 9)
    bm.register(table, hashes)
    bm.mark_computed(table, 4, epoch=0)
    bm.mark_computed(table, 8, epoch=1)
    bm.free(table)
    assert len(bm.match(hashes, 8, 0)) == 1
    assert bm.match(bm.chain_hashes(tokens, [], 1), 8, 1) == []
