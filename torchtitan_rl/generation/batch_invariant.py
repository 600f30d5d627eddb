"""Batch-invariant steps on CPU: a row's logits never depend on which rows share its step.

Without this, the same seeded request gets log-probs up to ~1.5e-6 apart when it arrives
alone, staggered or beside others: the matmul kernels pick another blocking for another
number of rows, the decode attention reduces over the batch's longest context, and a prefix
served from the cache was computed in another request's prefill. A near-tie in sampling then
flips a token, and replay of a seeded run is no longer exact. On CPU every step therefore
runs as one packed step (`ModelRunner.packed_step`) in which:

- every matmul has a multiple of `ROW_MULTIPLE` rows (padding rows are dropped): the CPU
  kernels then give each row the same bits whatever the number of rows and its place among
  them (checked for the model's shapes; `tests/test_batch_invariance.py` checks the engine);
- each token attends over a context width that depends on its own position only (the
  blocks up to it), tokens of equal width in one batched matmul (the batched matmul and
  softmax treat each batch element alone). Rounding widths up to fewer, wider groups is
  slower on CPU (docs/benchmarks.md, "Batch-invariant CPU steps");
- a prefill token is computed exactly as a decode token at its position, so keys/values
  in the prefix cache are the bits any other request would have written.

Shape legend: M = tokens of the step, N = block-table columns, S = context positions of one
width group, H = key/value heads, G = query heads per key/value head, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_MULTIPLE = 16
"""Rows of every matmul are padded to a multiple of this (at least this many)."""


def padded_rows(num_rows: int) -> int:
    return max(ROW_MULTIPLE, -(-num_rows // ROW_MULTIPLE) * ROW_MULTIPLE)


@dataclass(slots=True)
class WidthGroup:
    """The tokens of a step whose context is `width` blocks wide."""

    token_idx: torch.Tensor
    """Indices into the step's tokens, `[m]`."""
    table: torch.Tensor
    """Their block tables cut to `width` columns, `[m, width]`."""
    hidden: torch.Tensor
    """True at the keys each query must not see (after its position): `[H * m, G, S]`."""


def width_groups(
    pos_M: torch.Tensor,
    table_MN: torch.Tensor,
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    round_to: int = 1,
) -> list[WidthGroup]:
    """The step's tokens grouped by context width (module docstring); built once per step.
    `round_to`: widths rounded up to a multiple of this many blocks (fewer, wider groups;
    scripts/bench_batch_invariance.py compares)."""
    blocks_M = pos_M // block_size + 1
    width_M = torch.clamp(-(-blocks_M // round_to) * round_to, max=table_MN.shape[1])
    groups = []
    for width in torch.unique(width_M).tolist():
        idx = (width_M == width).nonzero().squeeze(1)
        key_pos_S = torch.arange(width * block_size, device=pos_M.device)
        hidden = (key_pos_S[None, :] > pos_M[idx, None]).repeat(num_kv_heads, 1)[:, None, :]
        groups.append(
            WidthGroup(
                token_idx=idx,
                table=table_MN[idx, :width],
                hidden=hidden.expand(-1, group, -1).contiguous(),
            )
        )
    return groups
