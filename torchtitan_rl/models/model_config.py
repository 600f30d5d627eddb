"""The [model] section: which Qwen3 shape, or which Hugging Face folder.

No torchtitan import here (nor below): the config, and every process that unpickles it (the
rollout processes), loads without torchtitan's package (7-8 s of imports on a 2-core VM).
models/qwen3.py builds the model these name.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_rl.hf_folder import check_hf_folder

BUILTIN_FLAVORS = ("tiny", "small")
"""The shapes of models/qwen3.py's `BUILTIN_ARGS`."""
QWEN3_FLAVORS = ("debugmodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B")
"""torchtitan's dense Qwen3 flavors (`torchtitan.models.qwen3.qwen3_args` without the MoE
ones; tests/test_qwen3_model.py checks the two agree)."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """TOML section [model]."""

    flavor: str = "tiny"
    """Random-init shape when hf_checkpoint is empty: "tiny", "small" or a torchtitan Qwen3 flavor
    ("0.6B", "1.7B", "4B", "8B", "14B", "32B")."""
    hf_checkpoint: str = ""
    """Local Hugging Face Qwen3 folder (config.json, tokenizer.json, *.safetensors); empty =
    the built-in tiny model and tokenizer."""
    max_seq_len: int = 1024
    """Longest sequence (prompt + completions) the model is set up for, in tokens."""

    def validate(self) -> None:
        valid = [*BUILTIN_FLAVORS, *QWEN3_FLAVORS]
        if self.flavor not in valid:
            raise ValueError(f"model.flavor: unknown flavor {self.flavor!r}; valid: {valid}")
        if self.hf_checkpoint:
            check_hf_folder("model.hf_checkpoint", self.hf_checkpoint, tokenizer=True)
        if self.max_seq_len < 16:
            raise ValueError(f"model.max_seq_len must be >= 16, got {self.max_seq_len}")
