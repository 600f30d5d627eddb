"""The policy model: packed documents are independent, HF folders load exactly."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from torchtitan_rl.models.qwen3 import (
    DenseMaskAttention,
    FlexAttention,
    ModelConfig,
    build_model,
    document_attention_mask,
    document_block_mask,
)

VOCAB = 128


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return build_model(ModelConfig(**kw), VOCAB, torch.device("cpu"))


def _full_logprobs(model, tokens_BS):
    """float64 reference: one unpacked document, full logits, log_softmax."""
    h = model.tok_embeddings(tokens_BS)
    mask = document_attention_mask(torch.zeros_like(tokens_BS))
    for layer in model.layers.values():
        h = layer(h, model.rope_cache, mask, None)
    logits = F.linear(model.norm(h), model.output.weight).double()
    return torch.log_softmax(logits, -1)


def test_packed_documents_match_separate_forwards():
    model = _model()
    a, b = torch.randint(0, VOCAB, (1, 7)), torch.randint(0, VOCAB, (1, 5))
    tokens = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    docs = torch.tensor([[0] * 7 + [1] * 5])
    targets = torch.randint(0, VOCAB, (12,))
    with torch.no_grad():
        lp, ent = model(tokens, positions, docs, torch.arange(12), targets)
        ref_a = _full_logprobs(model, a)[0]
        ref_b = _full_logprobs(model, b)[0]
    ref = torch.cat([ref_a, ref_b])
    expected = ref.gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp.double(), expected, atol=2e-5, rtol=0)
    expected_ent = -(ref.exp() * ref).sum(-1)
    torch.testing.assert_close(ent.double(), expected_ent, atol=2e-5, rtol=0)


def test_padding_does_not_change_real_tokens():
    model = _model()
    tokens = torch.randint(0, VOCAB, (1, 10))
    docs = torch.tensor([[0] * 6 + [-1] * 4])
    positions = torch.tensor([list(range(6)) + [0] * 4])
    targets = torch.randint(0, VOCAB, (6,))
    with torch.no_grad():
        lp, _ = model(tokens, positions, docs, torch.arange(6), targets)
        ref = _full_logprobs(model, tokens[:, :6])[0].gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp.double(), ref, atol=2e-5, rtol=0)


def test_the_config_names_torchtitans_dense_qwen3_flavors():
    """models/model_config.py lists the flavors without importing torchtitan; they are its."""
    from torchtitan.models.qwen3 import qwen3_args

    from torchtitan_rl.models.model_config import BUILTIN_FLAVORS, QWEN3_FLAVORS
    from torchtitan_rl.models.qwen3 import BUILTIN_ARGS

    assert QWEN3_FLAVORS == tuple(k for k in qwen3_args if "moe" not in k and "A" not in k)
    assert BUILTIN_FLAVORS == tuple(BUILTIN_ARGS)


def test_flex_attention_compiles_without_autotuning_and_matches_a_float64_reference():
    """The GPU model's FlexAttention (`use_flex_attention`) is compiled with Inductor's
    defaults, not torchtitan's max-autotune (53 s more first step on an H200, the same steady
    step: scripts/bench_flex_compile.py), and computes masked attention: packed documents and
    padding against float64 SDPA with the dense document mask (run here by Inductor's CPU
    backend, which has no float64)."""
    model = _model(flavor="tiny", max_seq_len=256)
    model.use_flex_attention()
    attentions = [layer.attention.inner_attention for layer in model.layers.values()]
    assert all(type(a) is FlexAttention for a in attentions)
    options = FlexAttention._compiled_defaults.get_compiler_config()
    assert not options["max_autotune"] and not options["coordinate_descent_tuning"]
    torch.manual_seed(0)
    docs_BS = torch.tensor([[0] * 100 + [1] * 120 + [-1] * 36, [0] * 256])
    q, k, v = (torch.randn(2, 4, 256, 16) for _ in range(3))
    out = attentions[0](q, k, v, block_mask=document_block_mask(docs_BS))
    dense = document_attention_mask(docs_BS)
    ref = DenseMaskAttention()(q.double(), k.double(), v.double(), block_mask=dense)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("trees", [False, True])
@pytest.mark.parametrize("S", [256, 200, 40])
def test_document_block_mask_covers_exactly_the_allowed_pairs(S, trees):
    """Every allowed (query, key) pair lies in a kept tile, a full tile holds only allowed
    pairs, and a tile is never both; S need not be a multiple of the block. With prefix
    trees (a shared prefix, then branches that must not see each other) too, and mask_mod
    settles every pair of the kept tiles exactly."""
    rng = np.random.default_rng(S)
    docs, branches = np.full((3, S), -1), np.zeros((3, S), dtype=np.int64)
    for r, used in enumerate([S - 8, S - 60, S]):  # packed documents, then padding
        pos, doc = 0, 0
        while pos < used:
            n = min(int(rng.integers(1, 90)), used - pos)
            docs[r, pos : pos + n] = doc
            if trees and n > 4:  # a prefix, then 1-3 branches of random lengths
                cuts = np.sort(rng.choice(np.arange(2, n), size=min(3, n - 2), replace=False))
                for k, (a, b) in enumerate(zip(cuts, [*cuts[1:], n]), start=1):
                    branches[r, pos + a : pos + b] = k
            pos, doc = pos + n, doc + 1
    if trees:  # one long tree: a prefix and two branches spanning whole blocks
        docs[2], branches[2] = 0, 0
        branches[2, S // 2 : 3 * S // 4], branches[2, 3 * S // 4 :] = 1, 2
    docs_BS, branch_BS = torch.from_numpy(docs), torch.from_numpy(branches)
    block = 32
    mask = document_block_mask(docs_BS, block=block, branch_ids_BS=branch_BS if trees else None)
    allowed_BSS = document_attention_mask(docs_BS, branch_BS if trees else None).dense_B1SS[:, 0]
    if trees:  # the branches really hide siblings somewhere
        assert (allowed_BSS != document_attention_mask(docs_BS).dense_B1SS[:, 0]).any()
    b, q, kv = torch.meshgrid(torch.arange(3), torch.arange(S), torch.arange(S), indexing="ij")
    assert torch.equal(mask.mask_mod(b, 0, q, kv), allowed_BSS)

    def tiles(num_B1N, idx_B1NN):
        nb = idx_B1NN.shape[-1]
        keep = torch.arange(nb)[None, None] < num_B1N[:, 0, :, None]
        out = torch.zeros(docs_BS.shape[0], nb, nb, dtype=torch.bool)
        out.scatter_(2, idx_B1NN[:, 0].long(), keep)
        return out.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :S, :S]

    partial = tiles(mask.kv_num_blocks, mask.kv_indices)
    full = tiles(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not (partial & full).any()
    assert not (allowed_BSS & ~(partial | full)).any()
    assert not (full & ~allowed_BSS).any()
    assert (partial & ~allowed_BSS).any()  # kept tiles may hold masked pairs
    assert full.any() or S < 2 * block
    assert mask.seq_lengths == (S, S)


def test_a_prefix_tree_gives_the_log_probs_and_gradients_of_its_branches_packed_whole():
    """float64: a shared prompt P once, then branches A and B (each starting from P's last
    token), against P+A and P+B as two separate documents; a third plain document after
    the tree checks that trees and plain documents share a row."""
    model = _model().double()
    P, A, B, C = (torch.randint(0, VOCAB, (n,)) for n in (6, 4, 3, 5))
    # whole: [P A] [P B] [C]; inputs are all tokens but the last of each document
    pa, pb = torch.cat([P, A]), torch.cat([P, B])
    w_tokens = torch.cat([pa[:-1], pb[:-1], C[:-1]])[None]
    w_pos = torch.cat([torch.arange(9), torch.arange(8), torch.arange(4)])[None]
    w_docs = torch.tensor([[0] * 9 + [1] * 8 + [2] * 4])
    w_targets = torch.cat([pa[1:], pb[1:], C[1:]])
    w_loss = torch.cat([torch.arange(5, 9), torch.arange(9 + 5, 9 + 8), torch.arange(17, 21)])
    # tree: P[:5] shared, then P[5] A[:-1] and P[5] B[:-1]; then C
    t_tokens = torch.cat([P[:5], P[5:], A[:-1], P[5:], B[:-1], C[:-1]])[None]
    t_pos = torch.cat([torch.arange(5), torch.arange(5, 9), torch.arange(5, 8), torch.arange(4)])
    t_docs = torch.tensor([[0] * 12 + [1] * 4])
    t_branch = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3 + [0] * 4])
    t_targets = torch.cat([A, B, C[1:]])
    t_loss = torch.cat([torch.arange(5, 9), torch.arange(9, 12), torch.arange(12, 16)])
    assert torch.equal(w_targets[w_loss], t_targets)

    def run(tokens, pos, docs, loss, targets, branch=None):
        model.zero_grad()
        lp, ent = model(tokens, pos[None] if pos.dim() == 1 else pos, docs, loss, targets,
                        branch_ids_BS=branch)  # fmt: skip
        weights = torch.linspace(-1, 2, lp.numel(), dtype=lp.dtype)
        ((weights * lp).sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]

    whole = run(w_tokens, w_pos, w_docs, w_loss, w_targets[w_loss])
    tree = run(t_tokens, t_pos, t_docs, t_loss, t_targets, t_branch)
    torch.testing.assert_close(tree[0], whole[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(tree[1], whole[1], atol=1e-12, rtol=0)
    for g_tree, g_whole in zip(tree[2], whole[2]):
        torch.testing.assert_close(g_tree, g_whole, atol=1e-11, rtol=0)
    # without the branch ids B would see A: different log-probs (the mask is what isolates)
    leaky = run(t_tokens, t_pos, t_docs, t_loss, t_targets)
    assert (leaky[0][4:7] - whole[0][4:7]).abs().max() > 1e-6


def test_gradients_reach_every_parameter():
    model = _model()
    tokens = torch.randint(0, VOCAB, (2, 8))
    docs = torch.zeros(2, 8, dtype=torch.long)
    positions = torch.arange(8).repeat(2, 1)
    lp, ent = model(tokens, positions, docs, torch.arange(16), torch.randint(0, VOCAB, (16,)))
    (lp.sum() + ent.sum()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing


def _write_hf_folder(model, path, tied):
    args = model.model_args
    state = {k: v for k, v in model.state_dict().items()}
    hf = Qwen3StateDictAdapter(args, None).to_hf(state)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.hidden_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 512,
    }
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("tied", [False, True])
def test_hf_folder_round_trip_gives_identical_logprobs(tmp_path, tied):
    source = _model(seed=1)
    if tied:
        source.output.weight = source.tok_embeddings.weight
        source.model_args.enable_weight_tying = True
    _write_hf_folder(source, tmp_path, tied)
    loaded = build_model(ModelConfig(hf_checkpoint=str(tmp_path)), VOCAB, torch.device("cpu"))
    assert loaded.model_args.enable_weight_tying == tied
    tokens = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        a = _full_logprobs(source, tokens)
        b = _full_logprobs(loaded, tokens)
    assert torch.equal(a, b)


def test_hf_folder_with_wrong_shape_names_the_tensor(tmp_path):
    source = _model(seed=1)
    _write_hf_folder(source, tmp_path, tied=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] += 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="feed_forward.w1.weight"):
        build_model(ModelConfig(hf_checkpoint=str(tmp_path)), VOCAB, torch.device("cpu"))


def test_hf_loads_into_transformers_parity_when_available(tmp_path):
    transformers = pytest.importorskip("transformers")
    source = _model(seed=2)
    _write_hf_folder(source, tmp_path, tied=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    tokens = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        ours = _full_logprobs(source, tokens)[0]
        theirs = torch.log_softmax(hf(tokens).logits[0].double(), -1)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-4)


def _built_the_old_way(config: ModelConfig, seed: int):
    """The whole model materialised in fp32, then torchtitan's init_weights."""
    from torchtitan_rl.models.qwen3 import PolicyModel, model_args

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = PolicyModel(model_args(config, VOCAB))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _recording_init(blocks: list):
    """PolicyModel.__init__ that also records the model's blocks in `blocks`."""
    from torchtitan_rl.models.qwen3 import PolicyModel

    init = PolicyModel.__init__

    def record(self, args):
        init(self, args)
        blocks.extend(self.layers.values())

    return record


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_block_by_block_build_holds_the_fp32_init_cast_to_its_dtype(monkeypatch, tied, dtype):
    """build_model draws each block in fp32 and casts it before the next: every parameter is
    bit for bit the whole-model fp32 init cast to `dtype`, tied weights stay one tensor,
    buffers stay fp32, and the random stream ends where the fp32 build's ends."""
    from torchtitan_rl.models.qwen3 import BUILTIN_ARGS, TINY_ARGS, PolicyModel

    monkeypatch.setitem(BUILTIN_ARGS, "tied", {**TINY_ARGS, "enable_weight_tying": tied})
    config = ModelConfig(flavor="tied")
    want = _built_the_old_way(config, seed=3)
    after_want = torch.rand(4)
    from torchtitan.models.qwen3.model.model import TransformerBlock

    fp32_blocks_seen, block_init = [], TransformerBlock.init_weights

    def init_and_count(block, buffer_device):  # what is held in fp32 while a block draws
        fp32_blocks_seen.append(
            sum(any(p.dtype == torch.float32 and not p.is_meta for p in b.parameters())
                for b in got_blocks)
        )  # fmt: skip
        block_init(block, buffer_device)

    got_blocks = []
    monkeypatch.setattr(PolicyModel, "__init__", _recording_init(got_blocks))
    monkeypatch.setattr(TransformerBlock, "init_weights", init_and_count)
    torch.manual_seed(3)
    got = build_model(config, VOCAB, torch.device("cpu"), dtype)
    assert torch.equal(torch.rand(4), after_want)
    # bf16: only the block being drawn is fp32 (fp32: all of them, as before)
    n = len(got_blocks)
    assert fp32_blocks_seen == ([1] * n if dtype == torch.bfloat16 else list(range(1, n + 1)))
    got_params = dict(got.named_parameters(remove_duplicate=False))
    assert got_params.keys() == dict(want.named_parameters(remove_duplicate=False)).keys()
    for name, p in want.named_parameters(remove_duplicate=False):
        assert got_params[name].dtype == dtype, name
        assert torch.equal(got_params[name], p.detach().to(dtype)), name
    assert (got.output.weight is got.tok_embeddings.weight) == tied
    for name, b in want.named_buffers():
        assert torch.equal(dict(got.named_buffers())[name], b), name
