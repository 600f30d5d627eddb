"""Write the policy as a Hugging Face Qwen3 folder that `transformers` and `load_hf_weights`
both load:

    <folder>/config.json              Qwen3ForCausalLM fields (copied from the source
                                      checkpoint when the run started from one)
    <folder>/model.safetensors        or model-0000k-of-0000n.safetensors + index.json
    <folder>/tokenizer.json           + tokenizer_config.json (+ the source's other files)
    <folder>/generation_config.json

Names and shapes come from torchtitan's `Qwen3StateDictAdapter.to_hf` (a tied model has no
`lm_head.weight`; `tie_word_embeddings` re-ties it). The folder appears atomically: it is
written next to its final name and renamed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from torchtitan_rl.device import DTYPES
from torchtitan_rl.models.renderer import CHAT_TEMPLATE
from torchtitan_rl.models.tokenizer import SHIPPED_TOKENIZER_PATH, Tokenizer

MAX_SHARD_BYTES = 5 * 2**30
"""Safetensors shard size, as transformers writes them by default."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
"""Files copied from a source Hugging Face folder when present."""


def hf_config(args: Qwen3ModelArgs, tokenizer: Tokenizer, dtype: str) -> dict:
    """config.json of a Qwen3ForCausalLM with `args`' shape (no source config to copy)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": args.enable_weight_tying,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": tokenizer.eos_id,
        "eos_token_id": tokenizer.im_end_id,
        "pad_token_id": tokenizer.pad_id,
        "torch_dtype": dtype,
    }


def export_hf(
    state: dict[str, torch.Tensor],
    args: Qwen3ModelArgs,
    folder: str | Path,
    *,
    hf_checkpoint: str = "",
    dtype: str = "float32",
) -> Path:
    """Write full (unsharded) torchtitan weights `state` as a Hugging Face folder.

    `hf_checkpoint` is the folder the run started from ("" for the built-in tokenizer): its
    config.json and tokenizer files are carried over so the export loads like the original.
    """
    if dtype not in DTYPES:
        raise ValueError(f"checkpoint.export_dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    hf_state = Qwen3StateDictAdapter(args, None).to_hf(state)
    _write_safetensors(
        {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in hf_state.items()},
        tmp,
    )
    _write_config_and_tokenizer(args, tmp, hf_checkpoint, dtype)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def _write_config_and_tokenizer(args, tmp: Path, hf_checkpoint: str, dtype: str) -> None:
    if hf_checkpoint:
        source = Path(hf_checkpoint)
        config = json.loads((source / "config.json").read_text())
        config["torch_dtype"] = dtype
        config.pop("dtype", None)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
    else:
        tokenizer = Tokenizer.from_file(None)
        config = hf_config(args, tokenizer, dtype)
        shutil.copy2(SHIPPED_TOKENIZER_PATH, tmp / "tokenizer.json")
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": args.max_seq_len,
            "chat_template": CHAT_TEMPLATE,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        generation = {"eos_token_id": [tokenizer.im_end_id, tokenizer.eos_id]}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))


def _write_safetensors(hf_state: dict[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in hf_state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in hf_state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
