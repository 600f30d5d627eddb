"""The seam between the generator actor and a generation engine, once for both backends.

- `GenerationEngine`: the one interface the generator actor drives;
- `EngineConfig`: the settings both engines read (TOML section [generator]);
- `request_error` / `error_completion`: which requests cannot be served, and how they come
  back;
- `AdapterUse`: how an engine takes [lora] adapters (weight_sync/lora_sync.py);
The asyncio front both engines share (`EngineFront`) lives in generation/front.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, Protocol, get_args

import numpy as np
import torch

from torchtitan_rl.checks import check_range
from torchtitan_rl.device import DTYPES, DtypeName
from torchtitan_rl.generation.backends import DEFAULT_BLOCK_SIZE, Backend, traits
from torchtitan_rl.types import Completion, FinishReason, SamplingParams

WeightSyncMode = Literal["hot_swap", "drain"]
DecodeAttention = Literal["auto", "gather", "triton"]
WEIGHT_SYNC_MODES = get_args(WeightSyncMode)
ReplicaDeath = Literal["restart", "stop"]
REPLICA_DEATHS = get_args(ReplicaDeath)
BACKEND_NAMES = get_args(Backend)
DECODE_ATTENTION = get_args(DecodeAttention)
"""Native decode attention: "gather" (blocks gathered, batched matmuls; any device), "triton"
(reads the paged cache in place; CUDA only; faster: docs/benchmarks.md, "Decode") or "auto"
(triton on CUDA, else gather)."""


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Generator settings; TOML section [generator]. Both backends read them, except where a
    key says "native only"."""

    backend: Backend = "native"
    """"native" (this package's engine) | "vllm" (vLLM in the generator process, started
    from a Hugging Face folder; `pip install` the vllm extra, README)."""
    num_replicas: int = 1
    """Generator replicas (each its own process and engine) behind a session-affine router;
    weights are pushed to all of them after every step."""
    on_replica_death: ReplicaDeath = "restart"
    """With num_replicas >= 2, what a replica's death does (controller/fleet.py): "restart"
    (its requests go to the live replicas; it is restarted and rejoins at the next weight
    sync) | "stop" (the run ends with one line). With one replica a death ends the run."""
    replicas_down_timeout_s: float = 600.0
    """With "restart": the run stops with one line once every replica has been down this
    long (> 0)."""
    max_num_seqs: int = 64
    """Concurrent sequences in the running batch, >= 1."""
    max_seq_len: int = 1024
    """Prompt + output tokens per sequence, >= 2; prompts may hold at most max_seq_len - 1."""
    dtype: DtypeName = "float32"
    """Weights, activations and KV cache dtype: "float32" | "bfloat16"."""
    block_size: int = 0
    """Tokens per KV cache block (the unit of allocation and of prefix reuse), >= 0; 0 picks
    the backend's: 16, or 32 for vLLM on CPU (where it must be a multiple of 32)."""
    num_blocks: int = 0
    """KV cache blocks; 0 sizes the cache for max_num_seqs full-length sequences. Fewer
    blocks admit fewer requests at once and preempt (recompute) when the cache fills; at
    least ceil(max_seq_len / block_size)."""
    enable_prefix_cache: bool = True
    """Reuse cached blocks of earlier sequences whose tokens a new prompt starts with."""
    weight_sync_mode: WeightSyncMode = "hot_swap"
    """"hot_swap": running requests continue under new weights from their next token;
    "drain": stop admitting, finish running requests, then swap (never mixes versions)."""
    recompute_on_sync: bool = False
    """After a weight pull, re-prefill running requests under the new weights (their blocks
    are then shareable again). Either way no request admitted after a pull reuses keys/values
    of older weights: the native prefix cache is keyed by weight load; vLLM's is reset, and
    without this key requests arriving while older ones run wait until those finish. vLLM
    serving [lora] adapters (lora.vllm_sync = "adapters") keys its cache by adapter, so
    nobody waits; without this key a running request finishes under its own adapter (its
    tokens labelled with that version), with it it moves onto the new one."""
    decode_attention: DecodeAttention = "auto"
    """Native only. Decode-step attention: "auto" (triton on CUDA, else gather) | "gather" (any device) |
    "triton" (paged kernel, CUDA only)."""
    gpu_memory_gib: float = 0.0
    """Most GPU memory torch may hold in each generator process, in GiB (>= 0; 0: no cap):
    weights, KV cache (`num_blocks`), CUDA graphs, weight syncs; going past it fails with
    CUDA out of memory. For a GPU shared with the trainer (see training.gpu_memory_gib).
    The CUDA context (~0.5 GiB) is outside it. No effect on CPU."""
    cuda_graphs: bool = True
    """On a CUDA device, compile the decode layers with torch.compile and capture the decode
    step as CUDA graphs (one per batch and context bucket, at engine start; vllm: its
    torch.compile and CUDA graphs, else eager); no effect on CPU."""
    batch_invariant: bool = False
    """Native only. On CUDA, a request's tokens and log-probs are the same bits whatever
    shares its steps (alone, together, staggered, reordered, behind a cached prefix): every
    step one packed step, the layers' matmuls and norms Triton kernels of one fixed
    configuration (no torch.compile), the sampler per row (docs/design.md, "Batch-invariant
    steps"); slower (docs/benchmarks.md). Needs decode_attention "auto" or "triton" and a
    dense model. No effect on CPU, where steps always are batch-invariant."""

    def validate(self) -> None:
        for name in ("num_replicas", "max_num_seqs"):
            check_range(f"generator.{name}", getattr(self, name), ge=1)
        check_range("generator.replicas_down_timeout_s", self.replicas_down_timeout_s, gt=0)
        if self.on_replica_death not in REPLICA_DEATHS:
            raise ValueError(
                f"generator.on_replica_death must be one of {REPLICA_DEATHS}, "
                f"got {self.on_replica_death!r}"
            )
        check_range("generator.block_size", self.block_size, ge=0)
        check_range("generator.gpu_memory_gib", self.gpu_memory_gib, ge=0)
        check_range("generator.max_seq_len", self.max_seq_len, ge=2)
        if self.dtype not in DTYPES:
            raise ValueError(f"generator.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        min_blocks = -(-self.max_seq_len // (self.block_size or DEFAULT_BLOCK_SIZE))
        if self.num_blocks != 0 and self.num_blocks < min_blocks:
            raise ValueError(
                f"generator.num_blocks must be 0 or >= ceil(max_seq_len / block_size) = "
                f"{min_blocks}, got {self.num_blocks}"
            )
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"generator.decode_attention must be one of {DECODE_ATTENTION}, "
                f"got {self.decode_attention!r}"
            )
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {self.backend!r}")
        own = traits(self.backend)
        if not own.own_decode_attention and self.decode_attention != "auto":
            raise ValueError(
                f"decode_attention={self.decode_attention!r} is native only: {own.label} "
                'picks its own attention; remove it or use backend = "native"'
            )
        if self.batch_invariant and not own.batch_invariant_mode:
            raise ValueError(
                f"generator.batch_invariant is native only: {own.label} has its own kernels; "
                'remove it or use backend = "native"'
            )
        if self.weight_sync_mode not in WEIGHT_SYNC_MODES:
            raise ValueError(
                f"weight_sync_mode must be one of {WEIGHT_SYNC_MODES}, "
                f"got {self.weight_sync_mode!r}"
            )

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with block_size = 0 resolved for the backend on `device_type`
        ("cpu", "cuda"); engines build from the result."""
        if self.block_size:
            return self
        size = traits(self.backend).default_block_size(device_type)
        return dataclasses.replace(self, block_size=size)

    def total_blocks(self) -> int:
        assert self.block_size, "resolve block_size = 0 with for_device() first"
        return self.num_blocks or self.max_num_seqs * -(-self.max_seq_len // self.block_size)


class AdapterUse(StrEnum):
    """How an engine takes the versions of a [lora] policy (weight_sync/lora_sync.py)."""

    FULL = "full"
    """The merged full weights at every sync (vLLM with lora.vllm_sync = "merged")."""
    MERGE = "merge"
    """The base once, then adapters, which the generator merges into its weights
    (W + scale * B @ A) before the engine loads them (the native engine)."""
    SERVE = "serve"
    """The base once, then adapters, which the engine applies at run time, each version as
    an adapter of its own (vLLM with lora.vllm_sync = "adapters")."""


class GenerationEngine(Protocol):
    """Implemented by the native `Engine` and by `VllmEngine` (`generator.backend`)."""

    adapter_use: AdapterUse
    """How this engine takes [lora] versions: what a weight sync sends it."""

    @property
    def policy_version(self) -> int:
        """Version of the weights the engine computes with now."""

    async def generate(
        self,
        prompt_ids: np.ndarray,
        *,
        request_id: str,
        session_id: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> Completion:
        """One completion with its sampling settings; an invalid request is an ERROR one."""

    def load_weights(
        self, state: Mapping[str, torch.Tensor], version: int, *, partial: bool = False
    ) -> None:
        """Queue full weights (torchtitan names), or with `partial` only those that changed
        (`AdapterUse.MERGE`: a mapping that makes each weight as it is read, lora_sync.py
        `MergedWeights`; `AdapterUse.SERVE`: a version's adapters, `*.lora_A` / `*.lora_B`
        and `lora.scale`, with the base's weights too at the first); applied between engine
        steps."""

    def model_parameters(self):
        """(name, tensor) of the model the engine computes with, in its own names and
        layouts (tests, debugging)."""

    async def close(self) -> None:
        """Fail outstanding requests and release the engine."""


def request_error(
    prompt_ids: np.ndarray, sampling: SamplingParams, max_seq_len: int, vocab_size: int
) -> str | None:
    """Why a request cannot be served (one line), or None; either backend answers it with
    an ERROR completion."""
    prompt = np.asarray(prompt_ids)
    limit = max_seq_len - 1
    if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
        return f"prompt_ids must be a 1-D integer array, got {prompt.dtype} {prompt.shape}"
    if prompt.shape[0] < 1:
        return "prompt_ids is empty"
    if prompt.shape[0] > limit:
        return (
            f"a prompt of {prompt.shape[0]} tokens does not fit generator.max_seq_len="
            f"{max_seq_len} (at most {limit} prompt tokens); raise generator.max_seq_len"
        )
    if prompt.min() < 0 or prompt.max() >= vocab_size:
        return f"prompt_ids must be in [0, {vocab_size}), got [{prompt.min()}, {prompt.max()}]"
    try:
        sampling.validate()
    except ValueError as exc:
        return f"sampling: {exc}"
    return None


def error_completion(request_id: str, error: str, policy_version: int = 0) -> Completion:
    """The answer to a request that could not be served: no tokens, `error` says why."""
    return Completion(
        request_id=request_id,
        token_ids_N=np.zeros(0, dtype=np.int32),
        logprobs_N=np.zeros(0, dtype=np.float32),
        finish_reason=FinishReason.ERROR,
        policy_version_min=policy_version,
        policy_version_max=policy_version,
        error=error,
    )
