"""Batcher: packs episodes into fixed-shape microbatches for the data-parallel ranks.

Shapes: R = rows_per_microbatch, S = seq_len. An episode of L tokens fills L - 1 slots of
a row: inputs are its tokens [0, L-1) and labels its tokens [1, L), so a label never
crosses into the next episode. Example row (S = 8) holding episodes x (4 tokens) and
y (3 tokens), pad p:
    input_ids     = x0 x1 x2 y0 y1 p  p  p
    labels        = x1 x2 x3 y1 y2 p  p  p
    positions     = 0  1  2  0  1  0  0  0
    document_ids  = 0  0  0  1  1  -1 -1 -1
    loss_mask     = loss_mask_x[1:4] + loss_mask_y[1:3] + [0]*3
so an episode of up to S + 1 tokens fits one row; longer ones are dropped and counted.

With `share_prefix`, the episodes of one group (GRPO's samples of one prompt) form one
document, a prefix tree: the tokens they all start with, up to the first trained one, once,
then each episode's rest, with `branch_ids` 0 on the prefix and k on the k-th branch (the
model's mask lets a branch see the prefix and itself). Prompt P = p0 p1 p2, answers a and b:
    input_ids     = p0 p1 | p2 a0 a1 | p2 b0
    labels        = p1 p2 | a0 a1 a2 | b0 b1
    positions     = 0  1  | 2  3  4  | 2  3
    branch_ids    = 0  0  | 1  1  1  | 2  2
A tree that would outgrow a row is cut into several, each with its own copy of the prefix.

Rows are filled first-fit decreasing, dealt to ranks (balanced by loss tokens, at most
ceil(rows / ranks) rows each), then cut into microbatches of R rows. Every microbatch is
[R, S] (short ones padded with empty rows), and every rank gets the same number of
microbatches (all-padding ones at the end) so the ranks' collectives match.
All counts are int64: an int8 mask summed in int8 wraps past 127.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from torchtitan_rl.reductions import Metric
from torchtitan_rl.types import Episode, Microbatch


@dataclass(kw_only=True, slots=True)
class BatcherConfig:
    """TOML section [batcher]."""

    seq_len: int = 512
    """Token slots per row (>= 1); an episode of up to seq_len + 1 tokens fits one row."""
    rows_per_microbatch: int = 4
    """Rows in one forward/backward (>= 1)."""
    share_prefix: bool = True
    """Pack the episodes of one group as a prefix tree: the tokens they all start with
    (the group's prompt, up to the first trained token) once, each continuation after
    it, attending to the prefix and to itself only. Same log-probs, fewer tokens (group
    of 8 x (75-token prompt + 14): 3.3x fewer); false packs every episode whole."""

    def validate(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"batcher.seq_len must be >= 1, got {self.seq_len}")
        if self.rows_per_microbatch < 1:
            raise ValueError(
                f"batcher.rows_per_microbatch must be >= 1, got {self.rows_per_microbatch}"
            )


@dataclass(slots=True)
class _Doc:
    """An episode placed in a row."""

    episode: Episode
    sequence_id: int
    num_slots: int
    num_loss_tokens: int
    num_finite_loss_tokens: int
    """Loss tokens whose generator log-prob is finite: the token-mean denominator (the loss
    drops non-finite ones from numerator and denominator alike)."""
    first_loss: int = 0
    """Index of the episode's first trained token."""


@dataclass(slots=True)
class _Unit:
    """What one document of a row holds: one episode whole (shared = 0), or a prefix tree:
    the `shared` first slots of its episodes once, then each episode's remaining slots."""

    docs: list[_Doc]
    shared: int = 0

    @property
    def num_slots(self) -> int:
        return self.shared + sum(d.num_slots - self.shared for d in self.docs)

    @property
    def num_loss_tokens(self) -> int:
        return sum(d.num_loss_tokens for d in self.docs)


def pack_batch(
    episodes: list[Episode], *, config: BatcherConfig, num_ranks: int, pad_id: int
) -> tuple[list[list[Microbatch]], dict[str, Metric]]:
    """Pack a step's episodes; returns (microbatches per rank, metrics).

    With nothing trainable, every rank gets an empty list.
    """
    config.validate()
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    docs, num_oversized, num_no_loss = _select_docs(episodes, config.seq_len)
    use_support = any(d.episode.support_offsets is not None for d in docs)
    assert not use_support or all(d.episode.support_offsets is not None for d in docs), (
        "some episodes carry sampling support and some do not"
    )

    units = _share_prefixes(docs, config.seq_len) if config.share_prefix else _singles(docs)
    rows = _first_fit_decreasing(units, config.seq_len)
    rows_per_rank = _deal_rows(rows, num_ranks)
    rpm = config.rows_per_microbatch
    num_microbatches = max(math.ceil(len(r) / rpm) for r in rows_per_rank)
    num_loss_tokens = sum(d.num_loss_tokens for d in docs)
    num_finite = sum(d.num_finite_loss_tokens for d in docs)
    totals = dict(num_global_loss_tokens=int(num_finite), num_global_sequences=len(docs))
    batches = [
        [
            _build_microbatch(
                rank_rows[i * rpm : (i + 1) * rpm], config, pad_id, use_support, **totals
            )
            for i in range(num_microbatches)
        ]
        for rank_rows in rows_per_rank
    ]

    total_slots = num_ranks * num_microbatches * rpm * config.seq_len
    used_slots = sum(u.num_slots for u in units)
    metrics = {
        "batcher/pct_pad_in_batch": Metric.mean(100.0 * (total_slots - used_slots), total_slots),
        "batcher/num_dropped_oversized": Metric.sum(float(num_oversized)),
        "batcher/num_dropped_no_loss": Metric.sum(float(num_no_loss)),
        "batcher/num_rows": Metric.sum(float(len(rows))),
        "batcher/num_loss_tokens": Metric.sum(float(num_loss_tokens)),
        "batcher/num_sequences": Metric.sum(float(len(docs))),
        "batcher/num_tokens": Metric.sum(float(used_slots)),
        "batcher/num_microbatches_per_rank": Metric.sum(float(num_microbatches)),
    }
    return batches, metrics


def _select_docs(episodes: list[Episode], seq_len: int) -> tuple[list[_Doc], int, int]:
    """Keep episodes that fit a row and have a trainable label; number them in input order."""
    docs: list[_Doc] = []
    num_oversized = num_no_loss = 0
    for episode in episodes:
        length = len(episode)
        if length > seq_len + 1:
            num_oversized += 1
            continue
        mask_L = np.asarray(episode.loss_mask_L).astype(bool)
        assert length == 0 or not mask_L[0], "an episode's first token has no context to train"
        num_loss = int(np.count_nonzero(mask_L[1:]))
        if num_loss == 0:
            num_no_loss += 1
            continue
        docs.append(
            _Doc(
                episode=episode,
                sequence_id=len(docs),
                num_slots=length - 1,
                num_loss_tokens=num_loss,
                num_finite_loss_tokens=int(
                    np.count_nonzero(mask_L[1:] & np.isfinite(episode.logprobs_L[1:]))
                ),
                first_loss=int(np.argmax(mask_L)),
            )
        )
    return docs, num_oversized, num_no_loss


def _singles(docs: list[_Doc]) -> list[_Unit]:
    return [_Unit([d]) for d in docs]


def _share_prefixes(docs: list[_Doc], seq_len: int) -> list[_Unit]:
    """Prefix trees of each group's episodes, in input order, cut where a tree would
    outgrow a row. The shared slots are inputs [0, p - 1) of the tokens all the group's
    episodes start with (p of them, p <= every first trained token), so their labels are
    the same untrained tokens in every episode; each branch starts at input p - 1.
    """
    by_group: dict[int, list[_Doc]] = {}
    for doc in docs:
        by_group.setdefault(doc.episode.group_id, []).append(doc)
    units: list[_Unit] = []
    for group in by_group.values():
        prefix = _common_prefix([d.episode.token_ids_L for d in group])
        shared = min(prefix, *(d.first_loss for d in group)) - 1
        if len(group) < 2 or shared < 1:
            units.extend(_singles(group))
            continue
        tree = _Unit([], shared)
        for doc in group:
            if tree.docs and tree.num_slots + doc.num_slots - shared > seq_len:
                units.append(tree if len(tree.docs) > 1 else _Unit(tree.docs))
                tree = _Unit([], shared)
            tree.docs.append(doc)
        units.append(tree if len(tree.docs) > 1 else _Unit(tree.docs))
    return units


def _common_prefix(arrays: list[np.ndarray]) -> int:
    """How many leading tokens all `arrays` share."""
    first, n = arrays[0], min(len(a) for a in arrays)
    same = np.ones(n, dtype=bool)
    for a in arrays[1:]:
        same &= a[:n] == first[:n]
    return int(np.argmin(same)) if not same.all() else n


def _first_fit_decreasing(units: list[_Unit], seq_len: int) -> list[list[_Unit]]:
    rows: list[list[_Unit]] = []
    free: list[int] = []
    for unit in sorted(units, key=lambda u: (-u.num_slots, u.docs[0].sequence_id)):
        for r, space in enumerate(free):
            if unit.num_slots <= space:
                rows[r].append(unit)
                free[r] -= unit.num_slots
                break
        else:
            rows.append([unit])
            free.append(seq_len - unit.num_slots)
    return rows


def _deal_rows(rows: list[list[_Unit]], num_ranks: int) -> list[list[list[_Unit]]]:
    """Give each rank at most ceil(rows / ranks) rows, greedily balancing loss tokens."""
    cap = math.ceil(len(rows) / num_ranks)
    per_rank: list[list[list[_Unit]]] = [[] for _ in range(num_ranks)]
    loss_per_rank = [0] * num_ranks
    row_loss = [sum(u.num_loss_tokens for u in row) for row in rows]
    for r in sorted(range(len(rows)), key=lambda r: (-row_loss[r], r)):
        rank = min(
            (k for k in range(num_ranks) if len(per_rank[k]) < cap),
            key=lambda k: (loss_per_rank[k], k),
        )
        per_rank[rank].append(rows[r])
        loss_per_rank[rank] += row_loss[r]
    return per_rank


def _build_microbatch(
    rows: list[list[_Unit]],
    config: BatcherConfig,
    pad_id: int,
    use_support: bool,
    *,
    num_global_loss_tokens: int,
    num_global_sequences: int,
) -> Microbatch:
    shape = (config.rows_per_microbatch, config.seq_len)
    input_ids_RS = np.full(shape, pad_id, dtype=np.int32)
    labels_RS = np.full(shape, pad_id, dtype=np.int32)
    positions_RS = np.zeros(shape, dtype=np.int32)
    document_ids_RS = np.full(shape, -1, dtype=np.int32)
    loss_mask_RS = np.zeros(shape, dtype=bool)
    logprobs_RS = np.zeros(shape, dtype=np.float32)
    advantages_RS = np.zeros(shape, dtype=np.float32)
    sequence_ids_RS = np.full(shape, -1, dtype=np.int32)
    branch_ids_RS = np.zeros(shape, dtype=np.int32)
    support_ids: list[np.ndarray] = []
    support_counts: list[np.ndarray] = []

    for r, row in enumerate(rows):
        start = 0
        for doc_index, unit in enumerate(row):
            s = unit.shared
            if s:  # the tree's shared prefix: inputs [0, s), untrained labels [1, s]
                ids = unit.docs[0].episode.token_ids_L
                input_ids_RS[r, start : start + s] = ids[:s]
                labels_RS[r, start : start + s] = ids[1 : s + 1]
                positions_RS[r, start : start + s] = np.arange(s, dtype=np.int32)
                document_ids_RS[r, start : start + s] = doc_index
                start += s
            for branch, doc in enumerate(unit.docs, start=1 if s else 0):
                ep, n = doc.episode, doc.num_slots - s
                span = slice(start, start + n)
                input_ids_RS[r, span] = ep.token_ids_L[s:-1]
                labels_RS[r, span] = ep.token_ids_L[s + 1 :]
                positions_RS[r, span] = np.arange(s, s + n, dtype=np.int32)
                document_ids_RS[r, span] = doc_index
                branch_ids_RS[r, span] = branch
                loss_mask_RS[r, span] = np.asarray(ep.loss_mask_L[s + 1 :]).astype(bool)
                logprobs_RS[r, span] = ep.logprobs_L[s + 1 :]
                advantages_RS[r, span] = ep.advantages_L[s + 1 :]
                sequence_ids_RS[r, span] = doc.sequence_id
                if use_support:
                    offsets = np.asarray(ep.support_offsets, dtype=np.int64)
                    assert offsets.shape[0] == doc.num_loss_tokens + 1, "support per loss token"
                    support_ids.append(np.asarray(ep.support_ids)[offsets[0] : offsets[-1]])
                    support_counts.append(np.diff(offsets))
                start += n
        assert start <= config.seq_len

    microbatch = Microbatch(
        input_ids_RS=input_ids_RS,
        labels_RS=labels_RS,
        positions_RS=positions_RS,
        document_ids_RS=document_ids_RS,
        loss_mask_RS=loss_mask_RS,
        logprobs_RS=logprobs_RS,
        advantages_RS=advantages_RS,
        sequence_ids_RS=sequence_ids_RS,
        num_global_loss_tokens=num_global_loss_tokens,
        num_global_sequences=num_global_sequences,
        branch_ids_RS=branch_ids_RS if branch_ids_RS.any() else None,
    )
    if use_support:
        counts = np.concatenate([np.zeros(0, np.int64), *support_counts])
        offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts, dtype=np.int64)])
        assert offsets[-1] <= np.iinfo(np.int32).max, "support CSR too large for int32 offsets"
        microbatch.support_ids = np.concatenate([np.zeros(0, np.int32), *support_ids]).astype(
            np.int32
        )
        microbatch.support_offsets = offsets.astype(np.int32)
    return microbatch
