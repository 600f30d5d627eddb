"""torchtitan's Qwen3, set up for RL training and generation.

One model definition serves both sides: the trainer runs `PolicyModel.forward` (packed
documents, log-probs of loss tokens only), the generator's engine runs the same modules
with a KV cache. Legend: B batch rows, S sequence length, N loss tokens, D model dim.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torchtitan.models.attention import FlexAttentionWrapper
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs, qwen3_args
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from torchtitan_rl.losses.logprobs import token_logprobs, vocab_parallel_token_logprobs
from torchtitan_rl.models.model_config import ModelConfig

TINY_ARGS = dict(
    dim=128,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    hidden_dim=512,
    qk_norm=True,
    rope_theta=10000.0,
    enable_weight_tying=False,
)
"""The built-in ~1.2M-parameter model: learns AlphabetSort on a laptop CPU in minutes."""
SMALL_ARGS = {**TINY_ARGS, "dim": 192, "n_layers": 6, "n_heads": 6, "hidden_dim": 768}
"""A ~3.6M-parameter variant of the tiny model: deeper and wider, ~3x its compute."""
BUILTIN_ARGS = {"tiny": TINY_ARGS, "small": SMALL_ARGS}


def model_args(config: ModelConfig, vocab_size: int) -> Qwen3ModelArgs:
    """Qwen3ModelArgs for the config; attention is flex-style (document masks) everywhere."""
    if config.hf_checkpoint:
        hf = json.loads((Path(config.hf_checkpoint) / "config.json").read_text())
        args = Qwen3ModelArgs(
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim=hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]),
            hidden_dim=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            # transformers 5 nests it under rope_parameters; older folders keep it on top
            rope_theta=hf.get("rope_parameters", {}).get("rope_theta", hf.get("rope_theta", 1e6)),
            enable_weight_tying=hf.get("tie_word_embeddings", False),
        )
    elif config.flavor in BUILTIN_ARGS:
        args = Qwen3ModelArgs(vocab_size=vocab_size, **BUILTIN_ARGS[config.flavor])
    else:
        base = qwen3_args[config.flavor]
        args = Qwen3ModelArgs(**{**base.__dict__, "vocab_size": vocab_size})
    args.max_seq_len = config.max_seq_len
    args.attn_type = "flex"
    args.attn_mask_type = "block_causal"
    return args


class DocumentMask(BlockMask):
    """A dense causal document mask [B, 1, S, S] dressed as a BlockMask.

    torchtitan's attention accepts only a BlockMask on its flex path, and FlexAttention has
    no CPU backward; on CPU we carry the dense mask through that path and run SDPA with it.
    """

    def __init__(self, dense_B1SS: torch.Tensor):  # noqa: D107 - BlockMask.__init__ skipped on purpose
        self.dense_B1SS = dense_B1SS

    def __repr__(self) -> str:
        return f"DocumentMask(shape={tuple(self.dense_B1SS.shape)})"


class DenseMaskAttention(nn.Module):
    """SDPA with an explicit boolean mask; the CPU stand-in for FlexAttentionWrapper."""

    def forward(self, q, k, v, *, block_mask: DocumentMask, scale=None, enable_gqa=False):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=block_mask.dense_B1SS, scale=scale, enable_gqa=enable_gqa
        )


def document_attention_mask(
    document_ids_BS: torch.Tensor, branch_ids_BS: torch.Tensor | None = None
) -> BlockMask:
    """Causal attention within each document; padding (-1) attends only to padding.

    A document may be a prefix tree (`branch_ids_BS`, None = all 0): its shared prefix is
    branch 0 and each continuation a branch k >= 1 laid out after it, so a token sees the
    shared prefix and the earlier tokens of its own branch, never a sibling branch.
    """
    if document_ids_BS.device.type == "cpu":
        allowed = document_ids_BS[:, :, None] == document_ids_BS[:, None, :]
        allowed &= torch.ones_like(allowed[0]).tril_()
        if branch_ids_BS is not None:
            q, kv = branch_ids_BS[:, :, None], branch_ids_BS[:, None, :]
            allowed &= (kv == 0) | (kv == q)
        return DocumentMask(allowed[:, None])
    return document_block_mask(document_ids_BS, branch_ids_BS=branch_ids_BS)


MASK_BLOCK = 128
"""Tokens per side of a FlexAttention mask tile (its default sparse block size)."""


def document_block_mask(
    document_ids_BS: torch.Tensor,
    block: int = MASK_BLOCK,
    branch_ids_BS: torch.Tensor | None = None,
) -> BlockMask:
    """The FlexAttention BlockMask of `document_attention_mask`, built per tile of
    block x block tokens from each block's range of document ids, O(B * (S / block)^2),
    instead of evaluating all B * S * S token pairs (create_block_mask's way).

    Tile (query block i, key block j) is kept when j <= i and the two id ranges overlap:
    a superset of the tiles holding an allowed pair, whose tokens mask_mod then settles. It
    is full (mask_mod skipped) when j < i, both blocks lie inside S, all their tokens
    belong to one and the same document, and each block lies in one branch, the key
    block's being the shared prefix (0) or the query block's.
    """
    docs, branches = document_ids_BS, branch_ids_BS
    B, S = docs.shape
    nb = -(-S // block)
    i = torch.arange(nb, device=docs.device)
    inside_N = (i + 1) * block <= S  # S need not fill the last block
    lo_BN, hi_BN = _block_ranges(docs, block)
    q_lo, q_hi = lo_BN[:, :, None], hi_BN[:, :, None]  # query block i, [B, N, 1]
    k_lo, k_hi = lo_BN[:, None, :], hi_BN[:, None, :]  # key block j, [B, 1, N]
    one_doc_BN = (lo_BN == hi_BN) & inside_N
    full_BNN = (i[:, None] > i) & (q_lo == k_lo)
    if branches is not None:  # one branch per block, the key block's 0 or the query's
        b_lo_BN, b_hi_BN = _block_ranges(branches, block)
        one_doc_BN &= b_lo_BN == b_hi_BN
        q_branch, k_branch = b_lo_BN[:, :, None], b_lo_BN[:, None, :]
        full_BNN &= (k_branch == 0) | (k_branch == q_branch)
    full_BNN &= one_doc_BN[:, :, None] & one_doc_BN[:, None, :]
    partial_BNN = (i[:, None] >= i) & (q_lo <= k_hi) & (k_lo <= q_hi) & ~full_BNN

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (docs[b, q] == docs[b, kv])

    def tree_mask_mod(b, h, q, kv):
        seen = (branches[b, kv] == 0) | (branches[b, kv] == branches[b, q])
        return mask_mod(b, h, q, kv) & seen

    return BlockMask.from_kv_blocks(
        *_ordered_blocks(partial_BNN), *_ordered_blocks(full_BNN),
        BLOCK_SIZE=block, mask_mod=mask_mod if branches is None else tree_mask_mod,
        seq_lengths=(S, S),
    )  # fmt: skip


def _block_ranges(ids_BS: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lowest and highest id in each block of `block` tokens, [B, N] each (the last id
    repeats past S, so a short last block keeps its range)."""
    B, S = ids_BS.shape
    nb = -(-S // block)
    tail_B = ids_BS[:, -1:].expand(B, nb * block - S)
    blocks_BNK = torch.cat([ids_BS, tail_B], dim=1).view(B, nb, block)
    return blocks_BNK.amin(-1), blocks_BNK.amax(-1)


def _ordered_blocks(tiles_BNN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query block: how many key blocks are kept, and their indices (kept ones first,
    ascending), shaped [B, 1, N] and [B, 1, N, N] for one broadcast head."""
    tiles = tiles_BNN[:, None].to(torch.int32)
    order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    return tiles.sum(-1, dtype=torch.int32), order.to(torch.int32)


class LogProbHead(nn.Linear):
    """The LM head; its forward returns log-probs (and entropy) of targets, never full logits.

    Same parameter name and shape as torchtitan's `output` Linear, so checkpoints and the
    Hugging Face adapter see an ordinary LM head. Under trainer tensor parallelism
    (`training/parallelize.apply_tp`) the weight is a DTensor sharded by vocabulary rows
    (Shard(0)) over the TP group: each rank computes its shard's statistics and
    `vocab_parallel_token_logprobs` combines them, so no rank holds full logits either.
    Replay rows (`support`) and plain logits gather the full weight instead.
    """

    def forward(self, hidden_ND, targets_N=None, temperature: float = 1.0, support=None):
        weight = self.weight
        if isinstance(weight, DTensor):
            if targets_N is not None and support is None:
                return self._vocab_parallel(hidden_ND, weight, targets_N, temperature)
            weight = weight.full_tensor()
        if targets_N is None:  # plain logits, for small diagnostics only
            return F.linear(hidden_ND, weight)
        return token_logprobs(
            hidden_ND, weight, targets_N, temperature=temperature, support=support
        )

    @staticmethod
    def _vocab_parallel(hidden_ND, weight: DTensor, targets_N, temperature: float):
        mesh = weight.device_mesh
        assert mesh.ndim == 1 and tuple(weight.placements) == (Shard(0),), weight.placements
        rows = -(-weight.shape[0] // mesh.size())  # Shard(0) splits rows as torch.chunk does
        start = mesh.get_local_rank() * rows
        shard_VD = weight.to_local()
        assert shard_VD.shape[0] == min(rows, weight.shape[0] - start), shard_VD.shape
        return vocab_parallel_token_logprobs(
            hidden_ND, shard_VD, targets_N, vocab_start=start, group=mesh.get_group(),
            temperature=temperature,
        )  # fmt: skip


class FlexAttention(FlexAttentionWrapper):
    """torchtitan's FlexAttentionWrapper with its kernels compiled by Inductor's defaults.

    torchtitan compiles FlexAttention with max-autotune, which times many kernel variants
    the first time each shape runs. On an H200 that added 53 s to the first training step
    of the 0.6B shape without `training.compile` (and 21 s to its first no-grad forward), and
    every steady step took the same time either way (scripts/bench_flex_compile.py). With
    `training.compile` each block's graph traces FlexAttention itself, and neither option
    applies. Unlike torchtitan's wrapper, `score_mod` is passed on, not dropped (the model
    passes none)."""

    _compiled_defaults = torch.compile(
        flex_attention,
        options={"wrap_inductor_compiled_regions": True, "triton.cudagraphs": False},
    )
    """A class attribute, as torchtitan's: one compiled function for all layers."""

    def forward(self, q, k, v, *, score_mod=None, block_mask=None, scale=None,
                return_lse=False, enable_gqa=False):  # fmt: skip
        """torchtitan's signature (its tensor-parallel plan wraps this module)."""
        return FlexAttention._compiled_defaults(
            q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
            enable_gqa=enable_gqa, return_lse=return_lse,
        )  # fmt: skip


class PolicyModel(Qwen3Model):
    """Qwen3 whose forward gathers hidden states at loss positions before the LM head."""

    def __init__(self, args: Qwen3ModelArgs):
        super().__init__(args)
        self.output = LogProbHead(args.dim, args.vocab_size, bias=False)
        if args.enable_weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def use_dense_attention(self) -> None:
        """Swap flex attention for masked SDPA (CPU: flex has no backward there)."""
        for layer in self.layers.values():
            layer.attention.inner_attention = DenseMaskAttention()

    def use_flex_attention(self) -> None:
        """FlexAttention with document block masks (`FlexAttention`); for GPUs."""
        for layer in self.layers.values():
            layer.attention.inner_attention = FlexAttention()

    def forward(
        self,
        tokens_BS: torch.Tensor,
        positions_BS: torch.Tensor,
        document_ids_BS: torch.Tensor,
        loss_index_N: torch.Tensor,
        targets_N: torch.Tensor,
        temperature: float = 1.0,
        support: tuple[torch.Tensor, torch.Tensor] | None = None,
        branch_ids_BS: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns fp32 (logprobs_N, entropy_N) of targets at flat positions loss_index_N;
        `branch_ids_BS` lays prefix trees out in documents (`document_attention_mask`)."""
        masks = document_attention_mask(document_ids_BS, branch_ids_BS)
        h = self.tok_embeddings(tokens_BS)
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, masks, positions_BS)
        h = self.norm(h)
        if isinstance(h, DTensor):  # tensor parallel: rows come sequence-sharded
            h = h.full_tensor()
        hidden_ND = h.flatten(0, 1).index_select(0, loss_index_N)
        return self.output(hidden_ND, targets_N, temperature, support)


def build_model(
    config: ModelConfig, vocab_size: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> PolicyModel:
    """A PolicyModel on `device` with initialised (or Hugging Face) weights; its parameters
    in `dtype` (buffers stay fp32). Every weight is drawn in fp32 and then cast, so a model
    built in bf16 holds the values of one built in fp32 and cast, without ever holding the
    whole model in fp32 (`_init_by_block`)."""
    args = model_args(config, vocab_size)
    with torch.device("meta"):
        model = PolicyModel(args)
    _init_by_block(model, device, dtype)
    if config.hf_checkpoint:
        load_hf_weights(model, config.hf_checkpoint)
    if device.type == "cpu":
        model.use_dense_attention()
    else:
        model.use_flex_attention()
    return model


@torch.no_grad()
def _init_by_block(model: PolicyModel, device: torch.device, dtype: torch.dtype) -> None:
    """torchtitan's `init_weights` on a meta-device model, materialising each transformer
    block in fp32 just before its init and casting it to `dtype` right after, so the fp32
    copy alive at any time is one block plus the embeddings, norm and head (the 8B shape:
    0.8 GB instead of 28 GB, which the caching allocator would keep as fragments after the
    cast). The random stream is drawn in torchtitan's own order, so the values are those of
    `to_empty` + `init_weights` in fp32 followed by a cast (tests/test_qwen3_model.py)."""

    def cast(module: nn.Module) -> None:
        for p in module.parameters():
            p.data = p.data.to(dtype)

    def block_init(block: nn.Module, init):
        def init_then_cast(buffer_device):
            block.to_empty(device=device)
            init(buffer_device)
            cast(block)

        return init_then_cast

    blocks = list(model.layers.values())
    for name, child in model.named_children():
        if name != "layers":
            child.to_empty(device=device)
    for block in blocks:  # an instance attribute: torchtitan's loop calls it in its order
        block.init_weights = block_init(block, block.init_weights)
    try:
        model.init_weights(buffer_device=device)
    finally:
        for block in blocks:
            del block.init_weights
    cast(model)
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not meta, f"left on the meta device by init_weights: {meta[:3]}"


def load_hf_weights(model: PolicyModel, folder: str) -> None:
    """Load *.safetensors from a Hugging Face Qwen3 folder, naming any mismatched tensor."""
    from safetensors.torch import load_file

    hf_state = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        hf_state.update(load_file(str(path)))
    state = Qwen3StateDictAdapter(model.model_args, None).from_hf(hf_state)
    own = model.state_dict()
    for name, tensor in own.items():
        if name not in state:
            raise ValueError(f"model.hf_checkpoint: tensor {name!r} missing in {folder}")
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"model.hf_checkpoint: tensor {name!r} has shape {tuple(state[name].shape)} "
                f"in {folder}, the model expects {tuple(tensor.shape)}"
            )
    model.load_state_dict({k: state[k] for k in own}, strict=True)
