"""Runs torchtitan's Qwen3 against a KV cache: batched prefill and batched decode.

torchtitan's model has no KV cache, so this module reuses the model's own submodules and
weights (embeddings, norms, projections, q/k norms, feed-forward, rotary table builder and
`apply_rotary_emb`) and only replaces the attention call: queries attend to the cached keys
of their own slot through SDPA with an explicit mask. Same weights, same math as the
training forward, so generator and trainer log-probs agree.

Shape legend: B = sequences in this forward, T = new tokens per sequence (padded),
S = cache positions read (longest sequence after this forward), M = real new tokens over
all sequences, E = model dim, Hq / Hkv = query / key-value heads, D = head dim, V = vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.model.model import apply_rotary_emb, precompute_rope_cache

from torchtitan_rl.generation.kv_cache import KVCache


@dataclass(kw_only=True, slots=True)
class _StepLayout:
    """Where the new tokens of one forward sit in the cache, shared by all layers."""

    slot_B: torch.Tensor
    """Cache slot of each sequence, int64."""
    pos_BT: torch.Tensor
    """Absolute position of each new token (padding reuses a real position), int64."""
    slot_M: torch.Tensor
    """Slot of each real new token, int64."""
    pos_M: torch.Tensor
    """Position of each real new token, int64."""
    valid_BT: torch.Tensor
    """True on real (non-padding) new tokens."""
    mask_B1TS: torch.Tensor
    """Attention mask: True where a query may attend a cached key (causal, own slot)."""
    read_len: int
    """Cache positions to read: the longest sequence length after this forward."""


class ModelRunner:
    """Prefill and decode for many sequence slots at once.

    Takes ownership of `model`: it is moved to `device` and cast to `dtype` in place, so
    `load_state_dict` updates the weights this runner computes with. The rotary table is
    rebuilt in fp32 (as training keeps it) for `max_seq_len` positions.
    """

    def __init__(
        self,
        model: Qwen3Model,
        *,
        max_slots: int,
        max_seq_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        args = model.model_args
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype)
        self.max_seq_len = max_seq_len
        self.vocab_size = args.vocab_size
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._rope_cache = precompute_rope_cache(args.head_dim, max_seq_len, args.rope_theta).to(
            self.device
        )
        with torch.inference_mode():
            self.kv_cache = KVCache(
                num_layers=args.n_layers,
                max_slots=max_slots,
                max_seq_len=max_seq_len,
                num_kv_heads=args.n_kv_heads or args.n_heads,
                head_dim=args.head_dim,
                device=self.device,
                dtype=dtype,
            )

    @torch.inference_mode()
    def prefill(self, slot_ids: list[int], prompts: list[torch.Tensor]) -> torch.Tensor:
        """Starts a new sequence in each slot from its prompt; returns fp32 logits `[n, V]`
        at each prompt's last position. Prompts of different lengths are right-padded."""
        if len(slot_ids) != len(prompts) or not prompts:
            raise ValueError(
                f"prefill needs one prompt per slot, got {len(slot_ids)} slots and "
                f"{len(prompts)} prompts"
            )
        lengths = [int(p.numel()) for p in prompts]
        for slot, n in zip(slot_ids, lengths):
            if not 1 <= n <= self.max_seq_len:
                raise ValueError(f"prompt length must be in [1, {self.max_seq_len}], got {n}")
            self._check_slot(slot)
            self.kv_cache.lengths[slot] = 0
        tokens_BT = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens_BT[row, : lengths[row]] = prompt.reshape(-1).to(torch.long)
        return self._forward(slot_ids, tokens_BT.to(self.device), lengths)

    @torch.inference_mode()
    def decode(self, slot_ids: list[int], token_ids: torch.Tensor) -> torch.Tensor:
        """Appends one token to each slot's sequence; returns fp32 next-token logits `[n, V]`."""
        if len(slot_ids) != token_ids.numel() or not slot_ids:
            raise ValueError(
                f"decode needs one token per slot, got {len(slot_ids)} slots and "
                f"{token_ids.numel()} tokens"
            )
        for slot in slot_ids:
            self._check_slot(slot)
            if self.kv_cache.lengths[slot] >= self.max_seq_len:
                raise ValueError(f"slot {slot} already holds max_seq_len={self.max_seq_len}")
        tokens_BT = token_ids.reshape(-1, 1).to(device=self.device, dtype=torch.long)
        return self._forward(slot_ids, tokens_BT, [1] * len(slot_ids))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copies every weight in place (torchtitan names, e.g. `layers.0.attention.wq.weight`).

        The state must cover every parameter (a tied parameter under either name); tensors
        must be plain (call `full_tensor()` on DTensors first) and may be any dtype/device.
        """
        unknown = sorted(set(state) - set(self._params))
        if unknown:
            raise ValueError(f"state has unknown parameter names: {unknown[:5]}")
        covered = {id(self._params[name]) for name in state}
        missing = [name for name, p in self._params.items() if id(p) not in covered]
        if missing:
            raise ValueError(f"state is missing parameters: {missing[:5]}")
        for name, tensor in state.items():
            param = self._params[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"state[{name!r}] has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            param.copy_(tensor)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.kv_cache.max_slots:
            raise ValueError(f"slot id must be in [0, {self.kv_cache.max_slots}), got {slot}")

    def _layout(self, slot_ids: list[int], new_lens: list[int], num_new: int) -> _StepLayout:
        device = self.device
        start_B = torch.tensor([self.kv_cache.lengths[s] for s in slot_ids], device=device)
        new_len_B = torch.tensor(new_lens, device=device)
        total = [self.kv_cache.lengths[s] + n for s, n in zip(slot_ids, new_lens)]
        assert max(total) <= self.max_seq_len, total
        t_T = torch.arange(num_new, device=device)
        valid_BT = t_T[None, :] < new_len_B[:, None]
        # Padding tokens reuse the row's first real position: in range for the rotary
        # table, never written to the cache, and their outputs are dropped.
        pos_BT = torch.where(valid_BT, start_B[:, None] + t_T[None, :], start_B[:, None])
        slot_B = torch.tensor(slot_ids, device=device)
        read_len = max(total)
        key_pos_S = torch.arange(read_len, device=device)
        # Query at position q sees its slot's keys at positions <= q; everything past the
        # slot's own length is excluded because q < that length.
        mask_B1TS = (key_pos_S[None, None, :] <= pos_BT[:, :, None])[:, None]
        return _StepLayout(
            slot_B=slot_B,
            pos_BT=pos_BT,
            slot_M=slot_B[:, None].expand_as(pos_BT)[valid_BT],
            pos_M=pos_BT[valid_BT],
            valid_BT=valid_BT,
            mask_B1TS=mask_B1TS,
            read_len=read_len,
        )

    def _forward(
        self, slot_ids: list[int], tokens_BT: torch.Tensor, new_lens: list[int]
    ) -> torch.Tensor:
        model = self.model
        layout = self._layout(slot_ids, new_lens, tokens_BT.shape[1])
        h_BTE = model.tok_embeddings(tokens_BT)
        for layer_idx, layer in enumerate(model.layers.values()):
            x_BTE = layer.attention_norm(h_BTE)
            h_BTE = h_BTE + self._attention(layer_idx, layer.attention, x_BTE, layout)
            ffn = layer.moe if layer.moe_enabled else layer.feed_forward
            h_BTE = h_BTE + ffn(layer.ffn_norm(h_BTE))
        for slot, n in zip(slot_ids, new_lens):
            self.kv_cache.lengths[slot] += n
        last_B = torch.tensor(new_lens, device=self.device) - 1
        h_BE = h_BTE[torch.arange(len(slot_ids), device=self.device), last_B]
        return model.output(model.norm(h_BE)).float()

    def _attention(
        self, layer_idx: int, attn: torch.nn.Module, x_BTE: torch.Tensor, layout: _StepLayout
    ) -> torch.Tensor:
        B, T, _ = x_BTE.shape
        q_BTHD = attn.wq(x_BTE).view(B, T, -1, attn.head_dim)
        k_BTHD = attn.wk(x_BTE).view(B, T, -1, attn.head_dim)
        v_BTHD = attn.wv(x_BTE).view(B, T, -1, attn.head_dim)
        if attn.q_norm is not None:
            q_BTHD = attn.q_norm(q_BTHD)
        if attn.k_norm is not None:
            k_BTHD = attn.k_norm(k_BTHD)
        q_BTHD, k_BTHD = apply_rotary_emb(q_BTHD, k_BTHD, self._rope_cache, layout.pos_BT)
        self.kv_cache.write(
            layer_idx,
            layout.slot_M,
            layout.pos_M,
            k_BTHD[layout.valid_BT],
            v_BTHD[layout.valid_BT],
        )
        k_BSHD, v_BSHD = self.kv_cache.read(layer_idx, layout.slot_B, layout.read_len)
        out_BHTD = F.scaled_dot_product_attention(
            q_BTHD.transpose(1, 2),
            k_BSHD.transpose(1, 2).to(q_BTHD.dtype),
            v_BSHD.transpose(1, 2).to(q_BTHD.dtype),
            attn_mask=layout.mask_B1TS,
            scale=attn.scaling,
            enable_gqa=attn.enable_gqa,
        )
        return attn.wo(out_BHTD.transpose(1, 2).reshape(B, T, -1))
