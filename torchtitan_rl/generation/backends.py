"""What differs between generation backends, one row per backend (`generator.backend`).

Everything outside generation/ reads a backend's traits here instead of comparing its
name, so a third backend is a row in `BACKENDS` plus its engine module (docs/design.md,
"Adding a backend"):

    traits("vllm").starts_from_hf_folder   # True: the controller exports a folder first
    traits("native").any_gpu_of_host       # True: placement may give it any GPU

Nothing here imports an engine: `BackendTraits.build` imports the factory it names when a
generator process builds its engine, so this module imports on any machine (vLLM absent).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

Backend = Literal["native", "vllm"]
DEFAULT_BLOCK_SIZE = 16
"""KV block tokens when generator.block_size = 0, unless the backend needs a multiple of
more on CPU (`cpu_block_multiple`)."""


@dataclass(frozen=True, slots=True)
class BackendTraits:
    """One backend's row: how it is built and what the rest of the package must know."""

    label: str
    """The backend's name in error lines ("vLLM")."""
    engine_factory: str
    """"module:function" building the engine: `(model, engine, vocab_size, device,
    hf_folder, lora) -> GenerationEngine` (`lora`: the [lora] section, or None); imported
    only by `build`. The engine says how it takes [lora] versions (`adapter_use`)."""
    starts_from_hf_folder: bool
    """The engine loads its first weights from a Hugging Face folder (model.hf_checkpoint,
    or one the controller exports from the trainer's initial policy before it starts)."""
    any_gpu_of_host: bool
    """The engine runs on whichever GPU placement gives it; False: only on GPU 0 (so it
    shares the trainer's GPU and parallelism.placement = "split" is refused)."""
    stop_texts: bool
    """rollout.stop (stop strings, matched as token sequences) is honoured."""
    own_decode_attention: bool
    """generator.decode_attention applies; False: the backend picks its own attention."""
    batch_invariant_mode: bool
    """generator.batch_invariant applies (the native engine's own kernels); False: refused."""
    cpu_block_multiple: int
    """On CPU, generator.block_size must be a multiple of this (1: any size)."""
    package: str | None
    """The import the backend needs, checked before any process starts; None: none."""
    install_hint: str
    """Where the install of `package` is described, for the "not installed" line."""
    gpu_adapter_dtypes: tuple[str, ...] = ()
    """The generator.dtype values with which the backend serves [lora] adapters on a GPU
    (lora.vllm_sync = "adapters"); (): it serves none (it merges them, whatever the key)."""

    def build(self, model, engine, vocab_size: int, device, hf_folder: str, lora=None):
        """The `GenerationEngine` for `engine` (an `EngineConfig`; `lora`: the run's
        `LoRAConfig`, None without), built by `engine_factory`, imported now (in the
        generator process)."""
        module, name = self.engine_factory.split(":")
        factory = getattr(importlib.import_module(module), name)
        return factory(model, engine, vocab_size, device, hf_folder, lora)

    def default_block_size(self, device_type: str) -> int:
        """generator.block_size = 0 resolved on `device_type` ("cpu", "cuda"):
        DEFAULT_BLOCK_SIZE, rounded up to `cpu_block_multiple` on CPU."""
        if device_type != "cpu":
            return DEFAULT_BLOCK_SIZE
        return -(-DEFAULT_BLOCK_SIZE // self.cpu_block_multiple) * self.cpu_block_multiple


BACKENDS: dict[Backend, BackendTraits] = {
    "native": BackendTraits(
        label="the native engine",
        engine_factory="torchtitan_rl.generation.engine:build_native_engine",
        starts_from_hf_folder=False,
        any_gpu_of_host=True,
        stop_texts=True,
        own_decode_attention=True,
        batch_invariant_mode=True,
        cpu_block_multiple=1,
        package=None,
        install_hint="",
    ),
    "vllm": BackendTraits(
        label="vLLM",
        engine_factory="torchtitan_rl.generation.vllm_engine:build_vllm_engine",
        starts_from_hf_folder=True,
        # vLLM puts its engine on the first visible GPU whatever device it is given
        any_gpu_of_host=False,
        # it generates token ids without text, and stop strings need text
        stop_texts=False,
        own_decode_attention=False,
        # vLLM's batch invariance is its own process-wide setting, not wired here
        batch_invariant_mode=False,
        # vLLM's CPU attention needs KV blocks of a multiple of 32 tokens (its default there)
        cpu_block_multiple=32,
        package="vllm",
        install_hint='see the README ("vLLM backend")',
        # its GPU LoRA kernels take 16-bit activations only ("assert inputs.dtype in
        # [torch.float16, torch.bfloat16]"); its CPU ones also float32
        gpu_adapter_dtypes=("bfloat16",),
    ),
}
"""Every `Backend` value's traits (tests/test_backends.py checks none is missing)."""


def check_served_adapter_dtype(backend: Backend, dtype: str, *, on_gpu: bool) -> None:
    """ValueError (one line naming both keys) where `backend` cannot serve [lora] adapters
    (lora.vllm_sync = "adapters") in generator.dtype `dtype` on a GPU; checked by the config
    and again by the engine on the GPU it got (the config may load on a host without one)."""
    allowed = BACKENDS[backend].gpu_adapter_dtypes
    if on_gpu and allowed and dtype not in allowed:
        raise ValueError(
            f'lora.vllm_sync = "adapters" with generator.dtype = "{dtype}": '
            f"{BACKENDS[backend].label} serves adapters on a GPU in {' or '.join(allowed)} "
            f'only; use generator.dtype = "{allowed[0]}" or lora.vllm_sync = "merged"'
        )


def traits(backend: Backend) -> BackendTraits:
    """The row of `backend` (a `Backend` value, already validated by the config)."""
    return BACKENDS[backend]
