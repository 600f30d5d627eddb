"""Write LoRA adapters as a PEFT adapter folder that `peft.PeftModel.from_pretrained` loads
onto the base Hugging Face model:

    <folder>/adapter_config.json        peft_type LORA, r, lora_alpha, target_modules, ...
    <folder>/adapter_model.safetensors  base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
                                        [r, in], ...lora_B.weight [out, r], one pair per module
    <folder>/base/                      only when no Hugging Face folder holds the run's
                                        base: a random init (no model.hf_checkpoint), or a
                                        base the warm start trained (warm_start.params =
                                        "all"); that base as a Hugging Face folder, which
                                        base_model_name_or_path names

PEFT computes W x + (alpha / r) * B A x, as models/lora.py does, so the adapter on the base
gives the trainer's policy; the merged Hugging Face export next to it gives the same.
The folder appears atomically (written next to its final name, then renamed).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torchtitan.models.qwen3 import Qwen3ModelArgs

from torchtitan_rl.device import DTYPES
from torchtitan_rl.models.hf_export import export_hf
from torchtitan_rl.models.lora import Adapters

PEFT_PREFIX = "base_model.model."
"""PEFT's prefix of a causal LM's module names in adapter_model.safetensors."""


def peft_state(adapters: Adapters, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors' tensors: PEFT key names, `dtype`, contiguous CPU."""
    out = {}
    for name, (a, b) in adapters.tensors.items():
        out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.to("cpu", dtype).contiguous()
        out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.to("cpu", dtype).contiguous()
    return out


def adapter_config(adapters: Adapters, base: str) -> dict:
    """adapter_config.json: a plain LoRA on the listed projections (no bias, no rsLoRA)."""
    targets = sorted({name.rsplit(".", 1)[1] for name in adapters.tensors})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": adapters.rank,
        "lora_alpha": adapters.alpha,
        "lora_dropout": 0.0,  # inference: dropout is a training-time choice
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "revision": None,
    }


def export_peft(
    adapters: Adapters,
    args: Qwen3ModelArgs,
    folder: str | Path,
    *,
    hf_checkpoint: str,
    base_state: dict[str, torch.Tensor],
    base_trained: bool = False,
    dtype: str = "float32",
) -> Path:
    """Write `adapters` as a PEFT folder; `base_state` (full torchtitan base weights) is
    exported into <folder>/base/ (config and tokenizer from `hf_checkpoint` when there is
    one) unless it is `hf_checkpoint`'s weights as loaded (`base_trained` False), which
    the config then names."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    base = hf_checkpoint
    if base_trained or not hf_checkpoint:
        export_hf(base_state, args, tmp / "base", hf_checkpoint=hf_checkpoint, dtype=dtype)
        base = str((folder / "base").resolve())
    save_file(
        peft_state(adapters, DTYPES[dtype]),
        str(tmp / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    (tmp / "adapter_config.json").write_text(json.dumps(adapter_config(adapters, base), indent=2))
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder
