"""Hugging Face export: export -> import gives the same model, and transformers agrees."""

import json

import numpy as np
import pytest
import torch

from torchtitan_rl.models.hf_export import export_hf
from torchtitan_rl.models.qwen3 import ModelConfig, build_model
from torchtitan_rl.models.tokenizer import Tokenizer

SEQ = 24


def _inputs(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens_BS = torch.randint(0, vocab, (2, SEQ), generator=g)
    positions_BS = torch.arange(SEQ).repeat(2, 1)
    document_ids_BS = torch.zeros(2, SEQ, dtype=torch.long)
    loss_index_N = torch.arange(2 * SEQ - 1)
    targets_N = tokens_BS.flatten()[1:]
    return tokens_BS, positions_BS, document_ids_BS, loss_index_N, targets_N


def _logprobs(model, vocab):
    model.eval()
    with torch.no_grad():
        logprobs_N, _ = model(*_inputs(vocab))
    return logprobs_N


def _trained_tiny():
    vocab = Tokenizer.from_file(None).vocab_size
    torch.manual_seed(0)
    model = build_model(ModelConfig(max_seq_len=64), vocab, torch.device("cpu"))
    with torch.no_grad():  # move off the init so norms and biases-free weights all matter
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model, vocab


def test_export_then_import_gives_identical_logprobs(tmp_path):
    model, vocab = _trained_tiny()
    folder = export_hf(model.state_dict(), model.model_args, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    imported = build_model(
        ModelConfig(hf_checkpoint=str(folder), max_seq_len=64), vocab, torch.device("cpu")
    )
    assert torch.equal(_logprobs(model, vocab), _logprobs(imported, vocab))
    assert Tokenizer.from_file(str(folder)).vocab_size == vocab


def test_export_is_sharded_past_the_shard_size(tmp_path, monkeypatch):
    from torchtitan_rl.models import hf_export

    monkeypatch.setattr(hf_export, "MAX_SHARD_BYTES", 200_000)
    model, vocab = _trained_tiny()
    folder = export_hf(model.state_dict(), model.model_args, tmp_path / "hf")
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    imported = build_model(
        ModelConfig(hf_checkpoint=str(folder), max_seq_len=64), vocab, torch.device("cpu")
    )
    assert torch.equal(_logprobs(model, vocab), _logprobs(imported, vocab))


def test_transformers_loads_the_export_with_the_same_logprobs(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, vocab = _trained_tiny()
    folder = export_hf(model.state_dict(), model.model_args, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokens_BS, *_, targets_N = _inputs(vocab)
    with torch.no_grad():
        logits_BSV = hf(input_ids=tokens_BS).logits
    hf_logprobs_N = torch.log_softmax(logits_BSV.flatten(0, 1)[:-1].double(), -1)
    hf_logprobs_N = hf_logprobs_N.gather(1, targets_N[:, None])[:, 0]
    ours_N = _logprobs(model, vocab).double()
    np.testing.assert_allclose(ours_N.numpy(), hf_logprobs_N.numpy(), atol=1e-5, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.decode(tok.encode("Sort these names")) == "Sort these names"


CONVERSATION = [
    {"role": "system", "content": "You sort names."},
    {"role": "user", "content": "Sort these names by last name.\nMary Young\nPaul Adams"},
    {"role": "assistant", "content": "<alphabetical_sorted>\nPaul Adams\n</alphabetical_sorted>"},
    {"role": "user", "content": "New names:\nLaura Hill  // spaces, digits 12 3"},
]


def _exported_template(tmp_path):
    model, _ = _trained_tiny()
    folder = export_hf(model.state_dict(), model.model_args, tmp_path / "hf")
    return folder, json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]


def test_exported_chat_template_renders_the_renderer_token_ids(tmp_path):
    """The exported template, rendered by Jinja as transformers does and tokenized by the
    exported tokenizer.json, gives exactly the renderer's prompt ids."""
    import jinja2
    from tokenizers import Tokenizer as HFTokenizer

    from torchtitan_rl.models.renderer import Renderer

    folder, template = _exported_template(tmp_path)
    text = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=CONVERSATION, add_generation_prompt=True)
    )
    ids = HFTokenizer.from_file(str(folder / "tokenizer.json")).encode(
        text, add_special_tokens=False
    )
    want = Renderer(Tokenizer.from_file(None)).render_prompt(CONVERSATION).tolist()
    assert ids.ids == want


def test_transformers_apply_chat_template_matches_the_renderer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torchtitan_rl.models.renderer import Renderer

    folder, _ = _exported_template(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a dict
    want = Renderer(Tokenizer.from_file(None)).render_prompt(CONVERSATION).tolist()
    assert list(ids) == want
