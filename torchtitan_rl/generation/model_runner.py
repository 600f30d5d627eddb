"""Runs torchtitan's Qwen3 against a paged KV cache: one forward over many sequences.

torchtitan's model has no KV cache, so this module reuses the model's own submodules and
weights (embeddings, norms, projections, q/k norms, feed-forward, rotary table and the
rotation of `apply_rotary_emb`, with cos/sin looked up once per forward instead of once per
layer) and only replaces the attention call: each query attends to the cached keys of its
own sequence, gathered through its block table. Same weights, same math as the training
forward, so generator and trainer log-probs agree.

Two paths over the same cache:
- padded (any number of new tokens per sequence: prefill, recompute): projections and
  feed-forward over the packed new tokens (no padding rows), SDPA with a mask over a
  padded `[B, T]` layout; eager;
- packed (`packed_step`): the new tokens of every row in one list, each token with its
  own position and block table, so decode rows (one token) and prefill rows (many) share
  one set of projections and one attention call per layer; static shapes and no host
  syncs, so it is captured in CUDA graphs: per batch and context bucket for pure decode
  steps, per token-count bucket for mixed steps (`cuda_graphs.py`). Mixed steps larger
  than the largest bucket, and every mixed step without CUDA graphs, take the padded path.

Batch-invariant mode (every CPU step; on CUDA with `batch_invariant`): every step is one
packed step, so a row's logits never depend on which rows share it (CPU:
generation/batch_invariant.py; CUDA: the layers' matmuls and norms are the Triton kernels
of generation/invariant_kernels.py, nothing is compiled, attention is the paged kernel
whose programs each serve one token, and steps are still replayed from CUDA graphs).

Shape legend: B = sequences in this forward, T = new tokens per sequence (padded),
M = new tokens of all sequences (packed), R = rows whose logits a packed step returns, N = blocks per block table, S = gathered cache
positions (N * block_size), E = model dim, Hq / Hkv = query / key-value heads
(G = Hq / Hkv), X = Hkv * B, D = head dim, V = vocab.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.model.model import precompute_rope_cache

from torchtitan_rl.device import to_device_async
from torchtitan_rl.generation import invariant_kernels
from torchtitan_rl.generation.batch_invariant import WidthGroup, padded_rows, width_groups
from torchtitan_rl.generation.interface import DECODE_ATTENTION
from torchtitan_rl.generation.kv_cache import PagedKVCache
from torchtitan_rl.generation.layers import (
    PACKED_QKV,
    PACKED_W13,
    head,
    layer_qkv,
    layer_rest,
    pack,
)
from torchtitan_rl.generation.paged_attention import paged_decode_attention


@dataclass(kw_only=True, slots=True)
class SeqInput:
    """One sequence's share of a forward; plain lists, so it pickles for TP broadcasts.

    Example: a 5-token prompt with 4 tokens cached in block 7 (block_size 4) prefills
    `token_ids=[p4], start=4, block_table=[7, 2]`; its next decode step is
    `token_ids=[a0], start=5, block_table=[7, 2]`.
    """

    token_ids: list[int]
    """New tokens fed this forward, at positions start, start + 1, ..."""
    start: int
    """Positions whose keys/values are already in the cache."""
    block_table: list[int]
    """Cache blocks of this sequence, covering at least start + len(token_ids) tokens."""


class ModelRunner:
    """Forwards over a paged cache. Takes ownership of `model` (moved and cast in place)."""

    def __init__(
        self,
        model: Qwen3Model,
        *,
        num_blocks: int,
        block_size: int,
        max_seq_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
        decode_attention: str = "auto",
        batch_invariant: bool = False,
    ) -> None:
        """`batch_invariant`: on CUDA, run every step batch-invariantly (module docstring;
        needs the triton attention and a dense model); CPU steps always are."""
        args = model.model_args
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype)
        self.dtype = dtype
        self.max_seq_len = max_seq_len
        self.vocab_size = args.vocab_size
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_seq_len // block_size)
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}"
            )
        if decode_attention == "triton" and self.device.type != "cuda":
            raise ValueError(f'decode_attention="triton" needs a CUDA device, got {self.device}')
        if decode_attention == "auto":
            decode_attention = "triton" if self.device.type == "cuda" else "gather"
        self.decode_attention = decode_attention
        self.batch_invariant = self.device.type == "cpu" or batch_invariant
        """Every step one batch-invariant packed step (module docstring)."""
        self.invariant_kernels = self.device.type == "cuda" and batch_invariant
        """The layers run generation/invariant_kernels.py, uncompiled (set once, here)."""
        self.query_group = args.n_heads // (args.n_kv_heads or args.n_heads)
        """G: query heads per key/value head (the same on every TP rank)."""
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._rope_cache = precompute_rope_cache(args.head_dim, max_seq_len, args.rope_theta).to(
            self.device
        )
        attn = next(iter(self.model.layers.values())).attention
        # One extra block: padding rows of a captured decode batch write there.
        self.scratch_block = num_blocks
        self.kv_cache = PagedKVCache(
            num_layers=args.n_layers,
            num_blocks=num_blocks + 1,
            block_size=block_size,
            num_kv_heads=attn.wk.weight.shape[0] // args.head_dim,
            head_dim=args.head_dim,
            device=self.device,
            dtype=dtype,
        )
        self.decode_graphs = None  # set by cuda_graphs.DecodeGraphs
        self.mixed_graphs = None  # set by cuda_graphs.MixedGraphs
        self.eager = {"eager_prefills": 0, "eager_prefill_tokens": 0}
        """Counters since start: eager (no graph) prefill calls and the tokens they fed: the
        padded path's, and on CUDA in batch-invariant mode the eager packed steps'."""
        self._layer_qkv, self._layer_rest = layer_qkv, layer_rest  # see compile_decode
        self._head = head
        if self.invariant_kernels:
            self._use_invariant_kernels()

    def _use_invariant_kernels(self) -> None:
        if self.decode_attention != "triton":
            raise ValueError(
                "generator.batch_invariant on CUDA needs generator.decode_attention "
                f'"auto" or "triton", got {self.decode_attention!r}'
            )
        if any(layer.moe_enabled for layer in self.model.layers.values()):
            raise ValueError("generator.batch_invariant on CUDA supports dense models, not MoE")
        self.pack_projections()
        ops = {"linear": invariant_kernels.linear, "norm": invariant_kernels.rms_norm}
        self._layer_qkv = functools.partial(layer_qkv, **ops)
        self._layer_rest = functools.partial(layer_rest, **ops)
        self._head = functools.partial(head, **ops)

    @torch.inference_mode()
    def forward(self, batch: list[SeqInput]) -> torch.Tensor:
        """Feeds each sequence its new tokens; returns fp32 logits `[B, V]` at each
        sequence's last new token, valid until the next forward. Multi-token sequences run first, so a sequence that
        shares blocks with one prefilled in this batch reads them already written."""
        if not batch:
            raise ValueError("forward needs at least one sequence")
        self._check(batch)
        if self.batch_invariant:
            return self._invariant_step(batch)
        multi = [i for i, s in enumerate(batch) if len(s.token_ids) > 1]
        if not multi:  # the common decode step; may be a view of a CUDA graph's output
            return self._decode(batch)
        if self.mixed_graphs is not None and self.mixed_graphs.fits(batch):
            return self.mixed_graphs.run(batch)
        single = [i for i, s in enumerate(batch) if len(s.token_ids) == 1]
        if not single:
            return self._forward_padded(batch)
        # Row indices staged like every other host input: indexing with a Python list
        # would copy it from pageable memory and wait for the device's queued work.
        multi_R, single_R = _staged(multi, self.device), _staged(single, self.device)
        logits_BV = torch.empty(len(batch), self.vocab_size, device=self.device)
        logits_BV.index_copy_(0, multi_R, self._forward_padded([batch[i] for i in multi]))
        logits_BV.index_copy_(0, single_R, self._decode([batch[i] for i in single]))
        return logits_BV

    def _invariant_step(
        self, batch: list[SeqInput], tokens_D: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`batch` as one batch-invariant packed step (module docstring); the first
        len(tokens_D) rows take their one token from `tokens_D` (on the device)."""
        if self.invariant_kernels:
            graphed = self._graphed_invariant_step(batch, tokens_D)
            if graphed is not None:
                return graphed
            prefill = [len(s.token_ids) for s in batch if len(s.token_ids) > 1]
            self.eager["eager_prefills"] += bool(prefill)
            self.eager["eager_prefill_tokens"] += sum(prefill)
        num_tokens, num_rows = sum(len(s.token_ids) for s in batch), len(batch)
        if not self.invariant_kernels:  # CPU matmuls are row-invariant at these row counts
            num_tokens, num_rows = padded_rows(num_tokens), padded_rows(num_rows)
        host = self.packed_inputs(batch, num_tokens, num_rows, self.max_blocks_per_seq)
        tokens_M, pos_M, table_MN, last_R = (to_device_async(t, self.device) for t in host)
        if tokens_D is not None:
            tokens_M[: len(tokens_D)] = tokens_D
        groups = None
        if self.decode_attention == "gather":
            groups = width_groups(
                pos_M,
                table_MN,
                block_size=self.block_size,
                num_kv_heads=self.kv_cache.k_L[0].shape[0],
                group=self.query_group,
            )
        return self.packed_step(tokens_M, pos_M, table_MN, last_R, groups=groups)[: len(batch)]

    def _graphed_invariant_step(
        self, batch: list[SeqInput], tokens_D: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The step replayed from a CUDA graph when one holds it, else None. Decode and
        mixed graphs capture the same kernels (each row's result is independent of the
        step's shape), so a token's bits do not depend on which graph, or none, ran it."""
        decode = all(len(s.token_ids) == 1 for s in batch)
        if (
            decode
            and self.decode_graphs is not None
            and (tokens_D is None or len(tokens_D) == len(batch))
        ):
            num_blocks = max(s.start // self.block_size + 1 for s in batch)
            return self.decode_graphs.run(batch, num_blocks, tokens_B=tokens_D)
        if self.mixed_graphs is not None and self.mixed_graphs.fits(batch):
            return self.mixed_graphs.run(batch, tokens_D)
        return None

    def _check(self, batch: list[SeqInput]) -> None:
        for seq in batch:
            end = seq.start + len(seq.token_ids)
            if not seq.token_ids or end > self.max_seq_len:
                raise ValueError(
                    f"a sequence must feed >= 1 token and end at <= max_seq_len="
                    f"{self.max_seq_len}, got {len(seq.token_ids)} tokens ending at {end}"
                )
            if len(seq.block_table) * self.block_size < end:
                raise ValueError(f"block table of {len(seq.block_table)} blocks < {end} tokens")

    @torch.inference_mode()
    def forward_look_ahead(
        self, decode: list[SeqInput], prefill: list[SeqInput], tokens_D: torch.Tensor
    ) -> torch.Tensor:
        """One step of decode rows whose tokens are on the device (`tokens_D[i]` is row i's
        token, as in `forward_decode`) and rows that feed tokens from the host (`prefill`,
        any number each); logits `[len(decode) + len(prefill), V]`, decode rows first."""
        self._check(prefill)
        if self.batch_invariant:
            return self._invariant_step(decode + prefill, tokens_D)
        if not prefill:
            return self.forward_decode(decode, tokens_D)
        if self.mixed_graphs is not None and self.mixed_graphs.fits(decode + prefill):
            return self.mixed_graphs.run(decode + prefill, tokens_D)
        logits_PV = self._forward_padded(prefill)
        if not decode:
            return logits_PV
        return torch.cat([self.forward_decode(decode, tokens_D), logits_PV])

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor], *, partial: bool = False) -> None:
        """Copies every weight in place (torchtitan names, e.g. `layers.0.attention.wq.weight`).

        The state must cover every parameter (a tied parameter under either name) unless
        `partial` (an adapter-only sync's merged weights); tensors must be plain (call
        `full_tensor()` on DTensors first) and may be any dtype/device. A `dict` is copied
        in one batched copy; any other mapping (an adapter-only sync's `MergedWeights`,
        whose values are made as they are read) one name at a time, each weight copied
        before the next is read, so only one of them need exist at a time.
        """
        unknown = sorted(set(state) - set(self._params))
        if unknown:
            raise ValueError(f"state has unknown parameter names: {unknown[:5]}")
        covered = {id(self._params[name]) for name in state}
        missing = [name for name, p in self._params.items() if id(p) not in covered]
        if missing and not partial:
            raise ValueError(f"state is missing parameters: {missing[:5]}")
        if not isinstance(state, dict):
            self._load_one_by_one(state)
            return
        pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, tensor in state.items():
            param = self._params[name]
            _check_shape(name, tensor, param)
            pairs[id(param)] = (param, tensor)  # a tied parameter is written once
        params, tensors = zip(*pairs.values(), strict=True)
        # one batched copy (dtype conversion included) instead of one launch per weight
        with torch.no_grad():
            torch._foreach_copy_(list(params), list(tensors))

    @torch.no_grad()
    def _load_one_by_one(self, state: Mapping[str, torch.Tensor]) -> None:
        written: set[int] = set()
        for name in state:
            param = self._params[name]
            if id(param) in written:  # a tied parameter is written once
                continue
            tensor = state[name]
            _check_shape(name, tensor, param)
            param.copy_(tensor)
            written.add(id(param))
            del tensor  # gone before the next weight is made

    def decode_inputs(self, batch: list[SeqInput], num_rows: int, num_blocks: int):
        """Host-built decode tensors padded to `num_rows` rows and `num_blocks` table
        columns; padding rows write into the scratch block. Built in numpy: a Python list
        of lists per step costs ~3x as much host time at batch 256."""
        n = len(batch)
        tokens_B = np.zeros(num_rows, dtype=np.int64)
        pos_B = np.zeros(num_rows, dtype=np.int64)
        tokens_B[:n] = [s.token_ids[0] for s in batch]
        pos_B[:n] = [s.start for s in batch]
        table_BN = self._block_tables(batch, num_rows, num_blocks)
        return torch.from_numpy(tokens_B), torch.from_numpy(pos_B), torch.from_numpy(table_BN)

    def _block_tables(self, batch: list[SeqInput], num_rows: int, num_blocks: int) -> np.ndarray:
        """Each row's block table cut or padded (scratch block) to `num_blocks` columns,
        `[num_rows, num_blocks]`; rows past the batch are all scratch."""
        table_BN = np.full((num_rows, num_blocks), self.scratch_block, dtype=np.int64)
        for i, s in enumerate(batch):
            row = s.block_table[:num_blocks]
            table_BN[i, : len(row)] = row
        return table_BN

    def _decode(self, batch: list[SeqInput]) -> torch.Tensor:
        num_blocks = max(s.start // self.block_size + 1 for s in batch)
        if self.decode_graphs is not None:
            return self.decode_graphs.run(batch, num_blocks)
        tokens_B, pos_B, table_BN = self.decode_inputs(batch, len(batch), num_blocks)
        device = self.device
        return self.decode_step(
            to_device_async(tokens_B, device),
            to_device_async(pos_B, device),
            to_device_async(table_BN, device),
        )

    @torch.inference_mode()
    def forward_decode(self, batch: list[SeqInput], tokens_B: torch.Tensor) -> torch.Tensor:
        """A decode step whose tokens are already on the device (`tokens_B[i]` is row i's
        token; `batch[i].token_ids` is ignored): the engine's look-ahead feeds the tokens
        of a sampling step that the host has not read yet. Logits as `forward`'s."""
        if self.batch_invariant:
            return self._invariant_step(batch, tokens_B)
        num_blocks = max(s.start // self.block_size + 1 for s in batch)
        if self.decode_graphs is not None:
            return self.decode_graphs.run(batch, num_blocks, tokens_B=tokens_B)
        _, pos_B, table_BN = self.decode_inputs(batch, len(batch), num_blocks)
        device = self.device
        return self.decode_step(
            tokens_B, to_device_async(pos_B, device), to_device_async(table_BN, device)
        )

    def decode_step(
        self, tokens_B: torch.Tensor, pos_B: torch.Tensor, table_BN: torch.Tensor
    ) -> torch.Tensor:
        """One token per row, static shapes, no host syncs: CUDA-graph capturable."""
        return self.packed_step(tokens_B, pos_B, table_BN)

    def packed_step(
        self,
        tokens_M: torch.Tensor,
        pos_M: torch.Tensor,
        table_MN: torch.Tensor,
        last_R: torch.Tensor | None = None,
        groups: list[WidthGroup] | None = None,
    ) -> torch.Tensor:
        """A step over M packed tokens of any rows, each with its own position and its
        row's block table (`table_MN[m]`); logits `[R, V]` at the tokens `last_R` (None: at
        every token). Each layer writes every token's key/value before any attends, and a
        query sees the keys at positions <= its own: a row's new tokens see each other
        causally, whatever rows share the step. Static shapes and no host syncs:
        CUDA-graph capturable (decode: one token per row; mixed steps: `cuda_graphs`).
        `groups`: attend per context-width group (generation/batch_invariant.py)."""
        cache = self.kv_cache
        slot_M = cache.slots(table_MN, pos_M[:, None]).squeeze(1)
        rope = self._rope(pos_M)
        gather = self.decode_attention == "gather"
        if gather and groups is None:
            key_pos_S = torch.arange(table_MN.shape[1] * self.block_size, device=self.device)
            # Keys after each token's position, masked in every layer: built once per step,
            # in the scores' own shape (a broadcast mask is slower to apply).
            Hkv = cache.k_L[0].shape[0]
            hidden_XGS = (key_pos_S[None, :] > pos_M[:, None]).repeat(Hkv, 1)[:, None, :]
            hidden_XGS = hidden_XGS.expand(-1, self.query_group, -1).contiguous()
        h_ME = self.model.tok_embeddings(tokens_M)
        for layer_idx, layer in enumerate(self.model.layers.values()):
            attn = layer.attention
            q_MHD, k_MHD, v_MHD = self._layer_qkv(layer, h_ME, *rope)
            cache.write(layer_idx, slot_M, k_MHD, v_MHD)
            if groups is not None:
                out_MHqD = torch.empty_like(q_MHD)
                for g in groups:
                    k_HmSD, v_HmSD = cache.gather(layer_idx, g.table)
                    out = _decode_attention(
                        q_MHD[g.token_idx], k_HmSD, v_HmSD, g.hidden, attn.scaling
                    )
                    out_MHqD.index_copy_(0, g.token_idx, out)
            elif gather:
                k_HMSD, v_HMSD = cache.gather(layer_idx, table_MN)
                out_MHqD = _decode_attention(q_MHD, k_HMSD, v_HMSD, hidden_XGS, attn.scaling)
            else:
                out_MHqD = paged_decode_attention(
                    q_MHD,
                    cache.k_L[layer_idx],
                    cache.v_L[layer_idx],
                    table_MN,
                    pos_M,
                    block_size=self.block_size,
                    scale=attn.scaling,
                    tile=128 if self.dtype == torch.bfloat16 else 64,
                )
            h_ME = self._layer_rest(layer, h_ME, out_MHqD)
        h_RE = h_ME if last_R is None else h_ME.index_select(0, last_R)
        return self._head(self.model, h_RE)

    def packed_inputs(
        self, batch: list[SeqInput], num_tokens: int, num_rows: int, num_blocks: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host tensors of `packed_step` for `batch`, padded to `num_tokens` tokens (they
        write and read the scratch block only), `num_rows` logits rows (repeats of token
        0) and `num_blocks` table columns: `(tokens_M, pos_M, table_MN, last_R)`."""
        lens_R = np.fromiter((len(s.token_ids) for s in batch), np.int64, len(batch))
        ends_R = np.cumsum(lens_R)
        M = int(ends_R[-1])
        tokens_M = np.zeros(num_tokens, dtype=np.int64)
        tokens_M[:M] = [t for s in batch for t in s.token_ids]
        offset_M = np.arange(M) - np.repeat(ends_R - lens_R, lens_R)
        pos_M = np.zeros(num_tokens, dtype=np.int64)
        pos_M[:M] = np.repeat([s.start for s in batch], lens_R) + offset_M
        table_RN = self._block_tables(batch, len(batch), num_blocks)
        table_MN = np.full((num_tokens, num_blocks), self.scratch_block, dtype=np.int64)
        table_MN[:M] = np.repeat(table_RN, lens_R, axis=0)
        last_R = np.zeros(num_rows, dtype=np.int64)
        last_R[: len(batch)] = ends_R - 1
        return tuple(torch.from_numpy(a) for a in (tokens_M, pos_M, table_MN, last_R))

    def pack_projections(self) -> None:
        """Packs each layer's query/key/value weights, and its feed-forward w1/w3, into one
        matrix each (the weights become views of it: same memory, weight pulls land in it),
        so each takes one matmul instead of three or two. Same math; the matmul shapes
        differ, so results may differ by rounding."""
        for layer in self.model.layers.values():
            pack(layer.attention, ("wq", "wk", "wv"), PACKED_QKV)
            if not layer.moe_enabled:
                pack(layer.feed_forward, ("w1", "w3"), PACKED_W13)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))

    def compile_decode(self) -> None:
        """Packs the projections (`pack_projections`) and compiles the parts of a layer
        around the cache write and the attention (norms, projections, rotation,
        feed-forward, residuals) with torch.compile, once for all layers (they differ only
        in weights) and every number of rows: at decode batch sizes these are many small
        kernels, which the compiler fuses (prefill uses the same compiled parts). For CUDA
        graphs (`cuda_graphs.py`); the first calls compile."""
        self.pack_projections()
        if self.invariant_kernels:  # compiled kernels may pick their reductions by shape
            return
        self._layer_qkv = torch.compile(layer_qkv, dynamic=True)
        self._layer_rest = torch.compile(layer_rest, dynamic=True)

    def _forward_padded(self, batch: list[SeqInput]) -> torch.Tensor:
        device, cache = self.device, self.kv_cache
        lens = [len(s.token_ids) for s in batch]
        self.eager["eager_prefills"] += 1
        self.eager["eager_prefill_tokens"] += sum(lens)
        B, T = len(batch), max(lens)
        N = max(-(-(s.start + n) // self.block_size) for s, n in zip(batch, lens))
        # Host inputs staged through pinned memory, and the real tokens picked out of the
        # padded [B, T] grid by integer index (`flat_M`, row-major), never by boolean mask:
        # no step of a prefill waits for the device (the look-ahead's queued decode).
        tokens_M = _staged([t for s in batch for t in s.token_ids], device)
        table_BN = _staged([(s.block_table[:N] + [0] * N)[:N] for s in batch], device)
        start_B = _staged([s.start for s in batch], device)
        len_B = _staged(lens, device)
        flat_M = _staged([b * T + t for b, n in enumerate(lens) for t in range(n)], device)
        t_T = torch.arange(T, device=device)
        valid_BT = t_T[None, :] < len_B[:, None]
        # Padding slots take the row's first position, so every query row of the padded
        # attention sees at least one key; their outputs are dropped.
        pos_BT = torch.where(valid_BT, start_B[:, None] + t_T[None, :], start_B[:, None])
        pos_M = pos_BT.flatten()[flat_M]
        slot_M = cache.slots(table_BN, pos_BT).flatten()[flat_M]
        key_pos_S = torch.arange(N * self.block_size, device=device)
        mask_B1TS = (key_pos_S[None, None, :] <= pos_BT[:, :, None])[:, None]
        rope = self._rope(pos_M)
        h_ME = self.model.tok_embeddings(tokens_M)
        for layer_idx, layer in enumerate(self.model.layers.values()):
            attn = layer.attention
            q_MHD, k_MHD, v_MHD = self._layer_qkv(layer, h_ME, *rope)
            cache.write(layer_idx, slot_M, k_MHD, v_MHD)
            k_HBSD, v_HBSD = cache.gather(layer_idx, table_BN)
            q_BTHD = q_MHD.new_zeros(B * T, *q_MHD.shape[1:])
            q_BTHD = q_BTHD.index_copy_(0, flat_M, q_MHD).view(B, T, *q_MHD.shape[1:])
            out_BHTD = F.scaled_dot_product_attention(
                q_BTHD.transpose(1, 2),
                k_HBSD.transpose(0, 1).repeat_interleave(self.query_group, dim=1).to(q_MHD.dtype),
                v_HBSD.transpose(0, 1).repeat_interleave(self.query_group, dim=1).to(q_MHD.dtype),
                attn_mask=mask_B1TS,
                scale=attn.scaling,
            )
            out_MHD = out_BHTD.transpose(1, 2).flatten(0, 1)[flat_M]
            h_ME = self._layer_rest(layer, h_ME, out_MHD)
        h_BE = h_ME[len_B.cumsum(0) - 1]
        return self._head(self.model, h_BE)

    def _rope(self, pos_M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, and sin with its first half negated, at each position: `[M, 1, D]` in the
        model's dtype (as `apply_rotary_emb` casts them); looked up once per forward and
        shared by all layers."""
        rope_M1X = self._rope_cache[pos_M][:, None, :]
        D = rope_M1X.shape[-1] // 2
        cos_M1D = rope_M1X[..., :D].to(self.dtype)
        sin_M1D = rope_M1X[..., D:].to(self.dtype)
        signed_sin_M1D = torch.cat([-sin_M1D[..., : D // 2], sin_M1D[..., D // 2 :]], dim=-1)
        return cos_M1D, signed_sin_M1D


def _staged(values: list, device: torch.device) -> torch.Tensor:
    """A host list on `device` without waiting for the device's queued work."""
    return to_device_async(torch.tensor(values), device)


def _check_shape(name: str, tensor: torch.Tensor, param: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"state[{name!r}] has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )


def _decode_attention(
    q_BHqD: torch.Tensor,
    k_HBSD: torch.Tensor,
    v_HBSD: torch.Tensor,
    hidden_XGS: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its gathered keys; query head h uses key head h // G.
    `hidden_XGS` (X = Hkv * B, head-major) is True at keys a query must not see.

    Keys stay in the cache's head-major layout, so both matmuls read them without a copy;
    scores and softmax run in fp32.
    """
    B, Hq, D = q_BHqD.shape
    Hkv, _, S, _ = k_HBSD.shape
    G = Hq // Hkv
    q_XGD = q_BHqD.view(B, Hkv, G, D).transpose(0, 1).reshape(Hkv * B, G, D)
    k_XSD = k_HBSD.reshape(Hkv * B, S, D).to(q_BHqD.dtype)
    v_XSD = v_HBSD.reshape(Hkv * B, S, D).to(q_BHqD.dtype)
    scores_XGS = torch.bmm(q_XGD, k_XSD.transpose(1, 2)).float() * scale
    # where() selects exactly what masked_fill would, and is faster on CPU
    probs_XGS = torch.softmax(torch.where(hidden_XGS, float("-inf"), scores_XGS), dim=-1)
    out_XGD = torch.bmm(probs_XGS.to(v_XSD.dtype), v_XSD)
    return out_XGD.view(Hkv, B, G, D).transpose(0, 1).reshape(B, Hq, D)
