"""CUDA graphs for the decode step: one graph per (batch bucket, block-table bucket).

A decode step of a 0.6B model is hundreds of small kernels; replaying them as one graph
removes the per-kernel launch cost that otherwise dominates at small batches, and the
layers' small kernels are first fused by torch.compile (`ModelRunner.compile_decode`). Shapes are
static inside a graph, so a step is padded up to the next batch bucket (padding rows write
into the runner's scratch block) and its block tables up to the next block bucket (the
attention reads, and masks, that many cache positions per sequence: buckets keep short
contexts from paying for the longest).

All graphs share one memory pool and the same static input buffers; their logits outputs
are separate tensors, valid until the next replay of the same graph.
"""

from __future__ import annotations

import bisect

import torch

from torchtitan_rl.device import to_device_async
from torchtitan_rl.generation.model_runner import ModelRunner, SeqInput


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 16 up to max_batch (always included)."""
    small = [b for b in (1, 2, 4, 8, 16) if b < max_batch]
    return [*small, *range(32, max_batch, 16), max_batch]


def block_buckets(max_blocks: int, step: int) -> list[int]:
    return [*range(step, max_blocks, step), max_blocks]


def capture(fn, args: tuple, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`fn(*args)` captured as a CUDA graph in memory pool `pool`, after one warm-up call
    on a side stream (library handles, workspaces, compiled kernels for these shapes):
    the graph and its output tensor, rewritten by each replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*args)
    return graph, out


class DecodeGraphs:
    """Captures `runner.decode_step` for every bucket pair and replays the matching one."""

    def __init__(self, runner: ModelRunner, *, max_batch: int, block_step: int = 16) -> None:
        if runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {runner.device}")
        self.runner = runner
        self.batches = batch_buckets(max_batch)
        self.blocks = block_buckets(runner.max_blocks_per_seq, block_step)
        B, N = self.batches[-1], self.blocks[-1]
        device = runner.device
        self._tokens_B = torch.zeros(B, dtype=torch.long, device=device)
        self._pos_B = torch.zeros(B, dtype=torch.long, device=device)
        self._table_BN = torch.full((B, N), runner.scratch_block, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        runner.compile_decode()  # compiled on the warm-up calls, before any capture
        self._capture_all()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # Largest first, so the pool is sized once by the biggest graph.
        for b in reversed(self.batches):
            for n in reversed(self.blocks):
                args = (self._tokens_B[:b], self._pos_B[:b], self._table_BN[:b, :n])
                self._graphs[(b, n)] = capture(self.runner.decode_step, args, self._pool)
        torch.cuda.synchronize()

    def run(
        self, batch: list[SeqInput], num_blocks: int, tokens_B: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits `[len(batch), V]` of one decode step (a view into the graph's output).
        `tokens_B`: the rows' tokens already on the device (then `token_ids` is ignored)."""
        b = self.batches[bisect.bisect_left(self.batches, len(batch))]
        n = self.blocks[bisect.bisect_left(self.blocks, num_blocks)]
        host_tokens_B, pos_B, table_BN = self.runner.decode_inputs(batch, b, n)
        device = self._tokens_B.device
        if tokens_B is None:
            self._tokens_B[:b].copy_(to_device_async(host_tokens_B, device))
        else:  # padding rows keep earlier (valid) ids: they only write the scratch block
            self._tokens_B[: len(batch)].copy_(tokens_B)
        self._pos_B[:b].copy_(to_device_async(pos_B, device))
        self._table_BN[:b, :n].copy_(to_device_async(table_BN, device))
        graph, out = self._graphs[(b, n)]
        graph.replay()
        return out[: len(batch)]


LONG_PREFILL = 256
"""A row feeding more tokens than this runs its step eagerly (padded path, SDPA)."""


def token_buckets(max_tokens: int) -> list[int]:
    """32, 64, 128, 256, 512, then every 256 up to max_tokens (always included)."""
    small = [t for t in (32, 64, 128, 256) if t < max_tokens]
    return [*small, *range(512, max_tokens, 256), max_tokens]


class MixedGraphs:
    """Captures `runner.packed_step` for every token-count bucket, for steps that mix decode
    rows with prefill rows (or prefill alone): one graph per bucket, table columns at the
    runner's maximum (the paged kernel reads each token's blocks up to its position only,
    so wider tables cost nothing), logits for up to min(bucket, max_rows) rows. A step
    larger than the largest bucket is not `fits`: the caller runs it eagerly."""

    def __init__(self, runner: ModelRunner, *, max_rows: int, max_tokens: int = 2048) -> None:
        if runner.device.type != "cuda" or runner.decode_attention != "triton":
            raise ValueError("mixed-step graphs need a CUDA device and the triton attention")
        self.runner = runner
        self.max_rows = max_rows
        self.buckets = token_buckets(max(max_tokens, 2 * max_rows))
        M, N = self.buckets[-1], runner.max_blocks_per_seq
        device = runner.device
        self._tokens_M = torch.zeros(M, dtype=torch.long, device=device)
        self._pos_M = torch.zeros(M, dtype=torch.long, device=device)
        self._table_MN = torch.full((M, N), runner.scratch_block, dtype=torch.long, device=device)
        self._last_R = torch.zeros(min(M, max_rows), dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = runner.decode_graphs._pool if runner.decode_graphs is not None else None
        self._pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._capture_all()

    def _rows(self, num_tokens: int) -> int:
        return min(num_tokens, self.max_rows)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        for m in reversed(self.buckets):
            args = (
                self._tokens_M[:m],
                self._pos_M[:m],
                self._table_MN[:m],
                self._last_R[: self._rows(m)],
            )
            self._graphs[m] = capture(self.runner.packed_step, args, self._pool)
        torch.cuda.synchronize()

    def fits(self, batch: list[SeqInput]) -> bool:
        """Whether a graph holds the step: rows and tokens within the largest bucket, and no
        row feeding more than `LONG_PREFILL` tokens (the eager path's attention reads a
        long prompt's keys once, the packed step once per token)."""
        return (
            len(batch) <= self.max_rows
            and sum(len(s.token_ids) for s in batch) <= self.buckets[-1]
            and max(len(s.token_ids) for s in batch) <= LONG_PREFILL
        )

    def run(self, batch: list[SeqInput], tokens_D: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[len(batch), V]` (a view into the graph's output). `tokens_D`: the tokens
        of the first len(tokens_D) rows (one token each) already on the device; their
        `token_ids` are ignored."""
        num_tokens = sum(len(s.token_ids) for s in batch)
        m = self.buckets[bisect.bisect_left(self.buckets, num_tokens)]
        r = self._rows(m)
        host = self.runner.packed_inputs(batch, m, r, self._table_MN.shape[1])
        device = self._tokens_M.device
        for buffer, values in zip(
            (self._tokens_M[:m], self._pos_M[:m], self._table_MN[:m], self._last_R[:r]), host
        ):
            buffer.copy_(to_device_async(values, device))
        if tokens_D is not None:
            self._tokens_M[: len(tokens_D)].copy_(tokens_D)
        graph, out = self._graphs[m]
        graph.replay()
        return out[: len(batch)]
