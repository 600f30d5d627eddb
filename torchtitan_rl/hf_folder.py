"""Checks a Hugging Face model folder named in the config before any process starts.

A folder the code can load holds config.json (model_type "qwen3" and the shape keys
`model_args` reads), weights as *.safetensors (every shard a model.safetensors.index.json
lists), and, where the run tokenizes with it, tokenizer.json. No torch import: config
validation stays cheap.
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL_TYPES = ("qwen3",)
"""config.json model types whose layout this package's Qwen3 definition loads."""
SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)
"""config.json keys `models.qwen3.model_args` needs: positive integers."""


def check_hf_folder(key: str, folder: str, *, tokenizer: bool) -> None:
    """ValueError, one line naming `key` and `folder`, unless the folder can be loaded;
    `tokenizer`: tokenizer.json must be there too."""
    path = Path(folder)
    where = f"{key}={folder!r}"
    if not path.is_dir():
        raise ValueError(f"{where}: no such folder (a Hugging Face model folder is expected)")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{where}: no config.json in the folder")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: config.json is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{where}: config.json holds {type(config).__name__}, not an object")
    _check_shapes(where, config)
    _check_weights(where, path)
    if tokenizer and not (path / "tokenizer.json").is_file():
        raise ValueError(f"{where}: no tokenizer.json in the folder")


def _check_shapes(where: str, config: dict) -> None:
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"{where}: config.json model_type={model_type!r}; this package loads {MODEL_TYPES}"
        )
    for name in SHAPE_KEYS:
        value = config.get(name)
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{where}: config.json {name} must be an integer > 0, got {value!r}")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    if not (isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads == 0):
        raise ValueError(
            f"{where}: config.json num_key_value_heads must be an integer > 0 dividing "
            f"num_attention_heads={heads}, got {kv_heads!r}"
        )
    head_dim = config.get("head_dim")
    if head_dim is None and config["hidden_size"] % heads:
        raise ValueError(
            f"{where}: config.json has no head_dim and hidden_size={config['hidden_size']} is "
            f"not a multiple of num_attention_heads={heads}"
        )
    if head_dim is not None and not (isinstance(head_dim, int) and head_dim > 0):
        raise ValueError(f"{where}: config.json head_dim must be an integer > 0, got {head_dim!r}")


def _check_weights(where: str, path: Path) -> None:
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"{where}: no *.safetensors weights in the folder")
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError) as e:
        raise ValueError(f"{where}: model.safetensors.index.json has no weight_map") from e
    missing = sorted(s for s in shards if not (path / s).is_file())
    if missing:
        raise ValueError(f"{where}: weight shards listed in the index are missing: {missing}")
