"""Paged key/value storage: fixed-size blocks of tokens, addressed through block tables.

A sequence's keys/values live in the blocks its block table lists, in order: token at
position p sits in block `table[p // block_size]`, row `p % block_size`. Which blocks a
sequence owns (and which it shares with others through the prefix cache) is decided by
`BlockManager`; this class only stores and gathers.

Layout per layer: `[Hkv, num_blocks * block_size, D]` (head-major), so gathering one
sequence's blocks gives `[Hkv, S, D]` rows that batched matmuls read without a copy.

Shape legend: L = layers, B = sequences in one forward, N = blocks per block table,
S = gathered cache positions (N * block_size), M = new tokens written (flattened),
H = key/value heads, D = head dim.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    """Keys and values of `num_blocks` blocks of `block_size` tokens, per layer."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_kv_heads, num_blocks * block_size, head_dim)
        self.k_L = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v_L = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]

    def slots(self, table_BN: torch.Tensor, pos_BT: torch.Tensor) -> torch.Tensor:
        """Flat cache row of each (sequence, position): `table[p // bs] * bs + p % bs`."""
        bs = self.block_size
        return table_BN.gather(1, pos_BT // bs) * bs + pos_BT % bs

    def write(self, layer: int, slot_M: torch.Tensor, k_MHD: torch.Tensor, v_MHD: torch.Tensor):
        """Stores one key/value per flat cache row."""
        self.k_L[layer].index_copy_(1, slot_M, k_MHD.transpose(0, 1).to(self.dtype))
        self.v_L[layer].index_copy_(1, slot_M, v_MHD.transpose(0, 1).to(self.dtype))

    def gather(self, layer: int, table_BN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every position each table covers, `[H, B, S, D]` each
        (S = N * block_size), copied a whole block at a time (one index per block, not
        per row: faster on CPU).

        Rows past a sequence's own length hold stale data (or another sequence's: padded
        table entries point anywhere); the caller masks them by position.
        """
        B, N = table_BN.shape
        H, _, D = self.k_L[layer].shape
        flat = table_BN.reshape(-1)
        blocks = (H, self.num_blocks, self.block_size * D)
        k_HBSD = self.k_L[layer].view(blocks).index_select(1, flat).view(H, B, -1, D)
        v_HBSD = self.v_L[layer].view(blocks).index_select(1, flat).view(H, B, -1, D)
        return k_HBSD, v_HBSD
