"""The parts of a Qwen3 decoder layer around its attention, for `ModelRunner`: norms,
projections, rotation, feed-forward, residuals, and the final norm and LM head; plus the
packing of q/k/v and w1/w3 into one matrix each.

They reuse the model's own submodules and weights, and take their matmul
(`linear(x_MK, w_NK)`) and norm (`norm(module, x)`): torch's by default (what
`ModelRunner.compile_decode` compiles), generation/invariant_kernels.py's in batch-invariant
mode on CUDA. With torch's they compute what the model's modules do, bit for bit.

Shape legend: B / M = rows (tokens), R = rows whose logits are wanted, E = model dim,
H / Hq = heads, D = head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_QKV, PACKED_W13 = "packed_qkv_weight", "packed_w13_weight"
"""Buffers that `pack` adds to attention and feed-forward modules
(`ModelRunner.pack_projections`)."""


def module_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A norm applied as the model defines it (the `norm` of the layer functions below)."""
    return module(x)


def layer_qkv(
    layer: torch.nn.Module, h_BE: torch.Tensor, cos_B1D, signed_sin_B1D, *,
    linear=F.linear, norm=module_norm,
):  # fmt: skip
    """A decode layer up to its attention: rotated queries, keys, and values."""
    x_BE = norm(layer.attention_norm, h_BE)
    return _qkv(layer.attention, x_BE, cos_B1D, signed_sin_B1D, linear=linear, norm=norm)


def layer_rest(
    layer: torch.nn.Module, h_BE: torch.Tensor, out_BHqD: torch.Tensor, *,
    linear=F.linear, norm=module_norm,
):  # fmt: skip
    """A decode layer after its attention: output projection, feed-forward, residuals."""
    h_BE = h_BE + linear(out_BHqD.flatten(1), layer.attention.wo.weight)
    return h_BE + _ffn(layer, h_BE, linear=linear, norm=norm)


def head(model: torch.nn.Module, h_RE: torch.Tensor, *, linear=F.linear, norm=module_norm):
    """fp32 logits `[R, V]` of the final hidden states."""
    return linear(norm(model.norm, h_RE), model.output.weight).float()


def _qkv(attn: torch.nn.Module, x_ME: torch.Tensor, cos_M1D, signed_sin_M1D, *, linear, norm):
    """Rotated queries and keys, and values, of each row: `[M, H, D]` each."""
    M, D = x_ME.shape[0], attn.head_dim
    packed = getattr(attn, PACKED_QKV, None)
    if packed is None:
        q_ME, k_ME, v_ME = (linear(x_ME, w.weight) for w in (attn.wq, attn.wk, attn.wv))
    else:  # one matmul (`pack`)
        sizes = [attn.wq.weight.shape[0], attn.wk.weight.shape[0], attn.wv.weight.shape[0]]
        q_ME, k_ME, v_ME = linear(x_ME, packed).split(sizes, dim=-1)
    q_MHD, k_MHD, v_MHD = q_ME.view(M, -1, D), k_ME.view(M, -1, D), v_ME.view(M, -1, D)
    if attn.q_norm is not None:
        q_MHD = norm(attn.q_norm, q_MHD)
    if attn.k_norm is not None:
        k_MHD = norm(attn.k_norm, k_MHD)
    # apply_rotary_emb's `x * cos + rotate_half(x) * sin`, bit for bit: rotate_half(x)
    # = cat(-x2, x1), and (-a) * b == a * (-b) exactly, so one roll replaces the
    # slices, negation and concatenation in every layer.
    q_MHD = q_MHD * cos_M1D + q_MHD.roll(D // 2, dims=-1) * signed_sin_M1D
    k_MHD = k_MHD * cos_M1D + k_MHD.roll(D // 2, dims=-1) * signed_sin_M1D
    return q_MHD, k_MHD, v_MHD


def _ffn(layer: torch.nn.Module, h: torch.Tensor, *, linear, norm) -> torch.Tensor:
    ffn = layer.moe if layer.moe_enabled else layer.feed_forward
    packed = getattr(ffn, PACKED_W13, None)
    if packed is None:  # MoE, or unpacked: the module's own forward (torch's ops)
        assert linear is F.linear, "invariant kernels need packed projections"
        return ffn(norm(layer.ffn_norm, h))
    gate, up = linear(norm(layer.ffn_norm, h), packed).chunk(2, dim=-1)  # w1, w3 in one matmul
    return linear(F.silu(gate) * up, ffn.w2.weight)


def pack(module: torch.nn.Module, names: tuple[str, ...], buffer: str) -> None:
    """Concatenates the weights of `module`'s linears `names` into one buffer and makes each
    weight a view of its rows, so copies into the weights (weight pulls) fill the buffer."""
    if hasattr(module, buffer):  # packed already
        return
    linears = [getattr(module, name) for name in names]
    if any(linear.bias is not None for linear in linears):
        raise ValueError(f"cannot pack {names}: they have biases")
    packed = torch.cat([linear.weight.detach() for linear in linears])
    module.register_buffer(buffer, packed, persistent=False)
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(packed[start : start + rows], requires_grad=False)
        start += rows
