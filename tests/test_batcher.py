import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_rl.reductions import results
from torchtitan_rl.rollout.batcher import BatcherConfig, pack_batch
from torchtitan_rl.types import Episode

PAD = -7


def make_episode(length, *, rng, loss_dtype=bool, with_support=False, all_loss=False):
    mask_L = np.ones(length, dtype=loss_dtype) if all_loss else rng.random(length) < 0.6
    mask_L = mask_L.astype(loss_dtype)
    mask_L[0] = 0
    tokens_L = rng.integers(0, 1000, size=length).astype(np.int32)
    episode = Episode(
        token_ids_L=tokens_L,
        loss_mask_L=mask_L,
        logprobs_L=np.where(mask_L, -rng.random(length), 0).astype(np.float32),
        advantages_L=np.where(mask_L, rng.normal(), 0).astype(np.float32),
    )
    if with_support:
        kept = tokens_L[mask_L.astype(bool)]
        episode.support_ids = np.stack([kept, kept + 1000], axis=1).reshape(-1)
        episode.support_offsets = np.arange(0, 2 * kept.shape[0] + 1, 2, dtype=np.int32)
    return episode


def trainable(episode, seq_len):
    return len(episode) <= seq_len + 1 and episode.loss_mask_L[1:].astype(bool).any()


def attention_mask_SS(document_ids_S):
    """Causal within a document, as the trainer builds it; padding attends nowhere."""
    same_doc = document_ids_S[:, None] == document_ids_S[None, :]
    causal = np.tril(np.ones((len(document_ids_S),) * 2, dtype=bool))
    return same_doc & causal & (document_ids_S[:, None] >= 0)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 45), min_size=0, max_size=14),
    seq_len=st.integers(4, 40),
    rows_per_microbatch=st.integers(1, 3),
    num_ranks=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_packing_keeps_every_loss_token_once_and_never_mixes_documents(
    lengths, seq_len, rows_per_microbatch, num_ranks, seed
):
    rng = np.random.default_rng(seed)
    episodes = [make_episode(n, rng=rng) for n in lengths]
    config = BatcherConfig(seq_len=seq_len, rows_per_microbatch=rows_per_microbatch)
    batches, metrics = pack_batch(episodes, config=config, num_ranks=num_ranks, pad_id=PAD)
    metrics = results(metrics)

    kept = [e for e in episodes if trainable(e, seq_len)]
    assert len(batches) == num_ranks
    assert len({len(b) for b in batches}) == 1  # same number of microbatches on every rank
    assert metrics["batcher/num_dropped_oversized"] == sum(n > seq_len + 1 for n in lengths)
    expected_loss = sum(int(e.loss_mask_L[1:].astype(bool).sum()) for e in kept)
    assert metrics["batcher/num_loss_tokens"] == expected_loss

    seen = {}  # (sequence id, position) -> (input, label, loss, logprob, advantage)
    total_slots = pad_slots = 0
    for mb in (mb for rank in batches for mb in rank):
        assert mb.input_ids_RS.shape == (rows_per_microbatch, seq_len)
        assert mb.loss_mask_RS.dtype == bool
        assert mb.num_global_loss_tokens == expected_loss
        assert mb.num_global_sequences == len(kept)
        total_slots += mb.input_ids_RS.size
        pad_slots += int((mb.document_ids_RS < 0).sum())
        for r in range(rows_per_microbatch):
            seq_S, pos_S, doc_S = mb.sequence_ids_RS[r], mb.positions_RS[r], mb.document_ids_RS[r]
            assert np.array_equal(seq_S < 0, doc_S < 0)
            assert not mb.loss_mask_RS[r][seq_S < 0].any()
            expected_SS = (
                (seq_S[:, None] == seq_S[None, :])
                & (pos_S[None, :] <= pos_S[:, None])
                & (seq_S[:, None] >= 0)
            )
            assert np.array_equal(attention_mask_SS(doc_S), expected_SS)
            for t in np.flatnonzero(seq_S >= 0):
                key = (int(seq_S[t]), int(pos_S[t]))
                assert key not in seen
                seen[key] = (
                    mb.input_ids_RS[r, t],
                    mb.labels_RS[r, t],
                    mb.loss_mask_RS[r, t],
                    mb.logprobs_RS[r, t],
                    mb.advantages_RS[r, t],
                )

    assert len(seen) == sum(len(e) - 1 for e in kept)
    for sequence_id, e in enumerate(kept):
        for p in range(len(e) - 1):
            token, label, loss, logprob, advantage = seen[(sequence_id, p)]
            assert token == e.token_ids_L[p] and label == e.token_ids_L[p + 1]
            assert loss == bool(e.loss_mask_L[p + 1])
            assert logprob == e.logprobs_L[p + 1] and advantage == e.advantages_L[p + 1]
    if total_slots:
        assert metrics["batcher/pct_pad_in_batch"] == pytest.approx(100 * pad_slots / total_slots)


def test_int8_mask_with_more_than_127_ones_counts_correctly():
    rng = np.random.default_rng(0)
    episodes = [make_episode(201, rng=rng, loss_dtype=np.int8, all_loss=True) for _ in range(2)]
    assert episodes[0].loss_mask_L.dtype == np.int8
    config = BatcherConfig(seq_len=256, rows_per_microbatch=2)
    batches, metrics = pack_batch(episodes, config=config, num_ranks=1, pad_id=0)
    metrics = results(metrics)
    (mb,) = batches[0]
    assert mb.num_global_loss_tokens == 400
    assert metrics["batcher/num_loss_tokens"] == 400
    assert mb.loss_mask_RS.dtype == bool and int(mb.loss_mask_RS.sum()) == 400


def test_episode_of_seq_len_plus_one_fits_and_longer_is_dropped_and_counted():
    rng = np.random.default_rng(1)
    fits, too_long = make_episode(9, rng=rng, all_loss=True), make_episode(10, rng=rng)
    config = BatcherConfig(seq_len=8, rows_per_microbatch=1)
    batches, metrics = pack_batch([fits, too_long], config=config, num_ranks=1, pad_id=0)
    metrics = results(metrics)
    (mb,) = batches[0]
    assert metrics["batcher/num_dropped_oversized"] == 1
    np.testing.assert_array_equal(mb.labels_RS[0], fits.token_ids_L[1:])
    assert metrics["batcher/pct_pad_in_batch"] == 0.0


def test_every_rank_gets_the_same_number_of_microbatches_padding_with_empty_ones():
    rng = np.random.default_rng(2)
    episodes = [make_episode(9, rng=rng, all_loss=True) for _ in range(3)]
    config = BatcherConfig(seq_len=8, rows_per_microbatch=2)
    batches, metrics = pack_batch(episodes, config=config, num_ranks=2, pad_id=PAD)
    metrics = results(metrics)
    assert [len(b) for b in batches] == [1, 1]
    assert [int((mb.document_ids_RS >= 0).any(axis=1).sum()) for mb in batches[0] + batches[1]] == [
        2,
        1,
    ]
    batches, _ = pack_batch(episodes[:1], config=config, num_ranks=3, pad_id=PAD)
    empty = batches[2][0]
    assert not empty.loss_mask_RS.any() and (empty.document_ids_RS == -1).all()
    assert (empty.input_ids_RS == PAD).all() and empty.num_global_loss_tokens == 8


def test_rows_are_balanced_by_loss_tokens_across_ranks():
    rng = np.random.default_rng(3)
    lengths = [9, 8, 7, 6]  # one row each, 8/7/6/5 loss tokens: a contiguous split gives 15/11
    episodes = [make_episode(n, rng=rng, all_loss=True) for n in lengths]
    config = BatcherConfig(seq_len=8, rows_per_microbatch=4)
    batches, _ = pack_batch(episodes, config=config, num_ranks=2, pad_id=0)
    per_rank = [sum(int(mb.loss_mask_RS.sum()) for mb in rank) for rank in batches]
    assert per_rank == [13, 13]


def test_no_episodes_gives_no_microbatches():
    batches, metrics = pack_batch([], config=BatcherConfig(), num_ranks=2, pad_id=0)
    metrics = results(metrics)
    assert batches == [[], []]
    assert metrics["batcher/num_rows"] == 0
    assert "batcher/pct_pad_in_batch" not in metrics  # no slots: no padding fraction to report


def test_support_csr_is_relaid_in_row_major_loss_token_order():
    rng = np.random.default_rng(4)
    episodes = [make_episode(n, rng=rng, with_support=True) for n in (6, 12, 4, 7)]
    config = BatcherConfig(seq_len=12, rows_per_microbatch=2)
    batches, _ = pack_batch(episodes, config=config, num_ranks=1, pad_id=0)
    num_checked = 0
    for mb in batches[0]:
        labels = mb.labels_RS[mb.loss_mask_RS]  # boolean indexing is row-major
        assert mb.support_offsets.shape[0] == labels.shape[0] + 1
        for i, label in enumerate(labels):
            kept = mb.support_ids[mb.support_offsets[i] : mb.support_offsets[i + 1]]
            np.testing.assert_array_equal(kept, [label, label + 1000])
            num_checked += 1
    assert num_checked == sum(int(e.loss_mask_L.sum()) for e in episodes)


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"seq_len": 0}, "seq_len"), ({"rows_per_microbatch": 0}, "rows_per")]
)
def test_bad_config_is_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        pack_batch([], config=BatcherConfig(**kwargs), num_ranks=1, pad_id=0)
    with pytest.raises(ValueError, match="num_ranks"):
        pack_batch([], config=BatcherConfig(), num_ranks=0, pad_id=0)


def tree_mask_SS(document_ids_S, branch_ids_S):
    """The trainer's mask for prefix trees: a branch sees the shared prefix (0) and itself."""
    kv, q = branch_ids_S[None, :], branch_ids_S[:, None]
    return attention_mask_SS(document_ids_S) & ((kv == 0) | (kv == q))


def group_episodes(rng, num_groups, max_size, prompt_len, max_answer, turns=1):
    """Groups of episodes that start with their group's prompt (then differ), as GRPO makes
    them; with turns > 1 an untrained env reply sits between trained answers."""
    episodes = []
    for g in range(num_groups):
        prompt = rng.integers(0, 50, size=int(rng.integers(1, prompt_len + 1)))
        for _ in range(int(rng.integers(1, max_size + 1))):
            parts, mask = [prompt], [np.zeros(len(prompt), bool)]
            for t in range(turns):
                if t:  # an env reply: untrained
                    parts.append(rng.integers(0, 50, size=3))
                    mask.append(np.zeros(3, bool))
                answer = rng.integers(0, 3, size=int(rng.integers(1, max_answer + 1)))
                parts.append(answer)  # few distinct tokens: siblings often start alike
                mask.append(np.ones(len(answer), bool))
            tokens, mask_L = np.concatenate(parts).astype(np.int32), np.concatenate(mask)
            episodes.append(
                Episode(
                    token_ids_L=tokens,
                    loss_mask_L=mask_L,
                    logprobs_L=np.where(mask_L, -rng.random(len(tokens)), 0).astype(np.float32),
                    advantages_L=np.where(mask_L, rng.normal(), 0).astype(np.float32),
                    group_id=g,
                )
            )
    return episodes


@settings(max_examples=60, deadline=None)
@given(
    num_groups=st.integers(1, 4),
    max_size=st.integers(1, 6),
    prompt_len=st.integers(1, 12),
    turns=st.integers(1, 2),
    seq_len=st.integers(16, 64),
    num_ranks=st.integers(1, 2),
    seed=st.integers(0, 2**32 - 1),
)
def test_prefix_trees_give_every_label_exactly_its_episode_context(
    num_groups, max_size, prompt_len, turns, seq_len, num_ranks, seed
):
    """Reading a packed row through the tree mask, each trained label sees exactly its own
    episode's tokens before it, at positions 0.. in order: the same context as packing the
    episode whole, from fewer slots."""
    rng = np.random.default_rng(seed)
    episodes = group_episodes(rng, num_groups, max_size, prompt_len, 6, turns)
    kept = [e for e in episodes if trainable(e, seq_len)]
    shared = BatcherConfig(seq_len=seq_len, rows_per_microbatch=2)
    whole = BatcherConfig(seq_len=seq_len, rows_per_microbatch=2, share_prefix=False)
    batches, metrics = pack_batch(episodes, config=shared, num_ranks=num_ranks, pad_id=PAD)
    _, whole_metrics = pack_batch(episodes, config=whole, num_ranks=num_ranks, pad_id=PAD)
    used, whole_used = (
        results(metrics)["batcher/num_tokens"],
        results(whole_metrics)["batcher/num_tokens"],
    )  # noqa: E501
    assert used <= whole_used == sum(len(e) - 1 for e in kept)

    seen = {}  # (sequence id, label index) -> (context, positions, label, logprob, advantage)
    for mb in (mb for rank in batches for mb in rank):
        branch_RS = (
            np.zeros_like(mb.document_ids_RS) if mb.branch_ids_RS is None else mb.branch_ids_RS
        )
        assert mb.num_global_sequences == len(kept)
        for r in range(mb.input_ids_RS.shape[0]):
            mask_SS = tree_mask_SS(mb.document_ids_RS[r], branch_RS[r])
            for t in np.flatnonzero(mb.loss_mask_RS[r]):
                sid = int(mb.sequence_ids_RS[r, t])
                visible = np.flatnonzero(mask_SS[t])
                context = mb.input_ids_RS[r, visible]
                key = (sid, len(context))  # label index = tokens before it
                assert key not in seen
                seen[key] = (
                    context, mb.positions_RS[r, visible], mb.labels_RS[r, t],
                    mb.logprobs_RS[r, t], mb.advantages_RS[r, t],
                )  # fmt: skip
    assert len(seen) == results(metrics)["batcher/num_loss_tokens"]
    for sid, e in enumerate(kept):
        for j in np.flatnonzero(e.loss_mask_L):
            context, positions, label, logprob, advantage = seen[(sid, int(j))]
            assert np.array_equal(context, e.token_ids_L[:j])
            assert np.array_equal(positions, np.arange(j))
            assert label == e.token_ids_L[j]
            assert logprob == e.logprobs_L[j] and advantage == e.advantages_L[j]


def test_a_group_packs_its_prompt_once_and_each_answer_after_it():
    prompt = np.array([5, 6, 7, 8], np.int32)
    episodes = [
        Episode(
            token_ids_L=np.concatenate([prompt, answer]).astype(np.int32),
            loss_mask_L=np.array([0, 0, 0, 0] + [1] * len(answer), bool),
            logprobs_L=np.zeros(4 + len(answer), np.float32),
            advantages_L=np.zeros(4 + len(answer), np.float32),
            group_id=3,
        )
        for answer in ([1, 2], [1, 3, 4], [9])
    ]
    config = BatcherConfig(seq_len=12, rows_per_microbatch=1)
    [[mb]], metrics = pack_batch(episodes, config=config, num_ranks=1, pad_id=PAD)
    # shared inputs 5 6 7, then each branch from the prompt's last token
    assert mb.input_ids_RS[0].tolist() == [5, 6, 7, 8, 1, 8, 1, 3, 8, PAD, PAD, PAD]
    assert mb.labels_RS[0].tolist() == [6, 7, 8, 1, 2, 1, 3, 4, 9, PAD, PAD, PAD]
    assert mb.positions_RS[0].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 3, 0, 0, 0]
    assert mb.branch_ids_RS[0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 0, 0, 0]
    assert mb.document_ids_RS[0].tolist() == [0] * 9 + [-1] * 3
    assert mb.sequence_ids_RS[0].tolist() == [-1, -1, -1, 0, 0, 1, 1, 1, 2, -1, -1, -1]
    assert mb.loss_mask_RS[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    assert results(metrics)["batcher/num_tokens"] == 9  # 5 + 6 + 4 = 15 packed whole
    # a row too short for the whole tree: it is cut, each part with its own prefix copy
    config = BatcherConfig(seq_len=8, rows_per_microbatch=2)
    [[mb]], metrics = pack_batch(episodes, config=config, num_ranks=1, pad_id=PAD)
    # the first two share a tree of 3 + 2 + 3 slots; the third is packed whole (4)
    assert results(metrics)["batcher/num_tokens"] == 3 + 2 + 3 + 4
    # share_prefix = false: every episode whole, no branch ids
    config = BatcherConfig(seq_len=16, rows_per_microbatch=1, share_prefix=False)
    [[mb]], metrics = pack_batch(episodes, config=config, num_ranks=1, pad_id=PAD)
    assert mb.branch_ids_RS is None and results(metrics)["batcher/num_tokens"] == 15
