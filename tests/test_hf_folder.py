"""Hugging Face folders named in the config are checked when it loads, before any spawn."""

import json
from pathlib import Path

import pytest
from fakes import tiny_qwen3

from torchtitan_rl.config import ConfigError, load_config
from torchtitan_rl.models.hf_export import export_hf

TINY = Path(__file__).resolve().parents[1] / "train_configs" / "alphabet_sort_tiny.toml"
CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 97,
}


def _folder(tmp_path: Path, config=CONFIG, files=("model.safetensors", "tokenizer.json")) -> str:
    folder = tmp_path / "hf"
    folder.mkdir()
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (folder / "config.json").write_text(text)
    for name in files:
        (folder / name).write_text("{}")
    return str(folder)


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    return str(e.value)


def _reference(folder: str) -> list[str]:
    return ["--loss.kl_coef=0.1", f"--loss.kl_reference={folder}"]


def test_a_missing_kl_reference_folder_is_a_config_error(tmp_path):
    missing = str(tmp_path / "nope")
    message = _error(_reference(missing))
    assert message.startswith(f"loss.kl_reference={missing!r}: no such folder")
    assert "\n" not in message


@pytest.mark.parametrize(
    "config, files, fragment",
    [
        (None, ("model.safetensors",), "no config.json"),
        ("{not json", ("model.safetensors",), "config.json is not valid JSON"),
        ({**CONFIG, "model_type": "llama"}, ("model.safetensors",), "model_type='llama'"),
        ({**CONFIG, "hidden_size": None}, ("model.safetensors",), "hidden_size must be an int"),
        ({**CONFIG, "num_key_value_heads": 3}, ("model.safetensors",), "num_key_value_heads"),
        (CONFIG, (), "no *.safetensors weights"),
    ],
)
def test_a_folder_the_code_cannot_load_is_named_with_its_fault(tmp_path, config, files, fragment):
    folder = _folder(tmp_path, config, files)
    message = _error(_reference(folder))
    assert message.startswith(f"loss.kl_reference={folder!r}: ") and fragment in message


def test_a_shard_missing_from_the_index_is_named(tmp_path):
    folder = _folder(tmp_path, files=("model-00001-of-00002.safetensors",))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002"}}
    (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "missing: ['model-00002-of-00002']" in _error(_reference(folder))


def test_the_policy_folder_also_needs_a_tokenizer(tmp_path):
    folder = _folder(tmp_path, files=("model.safetensors",))
    assert load_config(TINY, _reference(folder)).loss.kl_reference == folder
    message = _error([f"--model.hf_checkpoint={folder}"])
    assert message == f"model.hf_checkpoint={folder!r}: no tokenizer.json in the folder"


def test_an_exported_folder_passes_both_checks(tmp_path):
    model = tiny_qwen3()
    folder = str(export_hf(model.state_dict(), model.model_args, tmp_path / "hf"))
    config = load_config(TINY, [f"--model.hf_checkpoint={folder}", *_reference(folder)])
    assert config.model.hf_checkpoint == config.loss.kl_reference == folder
