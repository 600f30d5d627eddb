"""vLLM serving [lora] versions as LoRA adapters (`lora.vllm_sync = "adapters"`).

vLLM is built with LoRA (`lora_engine_args`) and holds the frozen base as its weights; each
version's adapters arrive as tensors (weight_sync/lora_sync.py `ServedBase`), are written as
a PEFT folder (models/peft_export.py: adapter_config.json + adapter_model.safetensors,
Hugging Face names) under a directory of this engine's (in /dev/shm where there is one), and
registered as an adapter of their own:

    LoRARequest(lora_name="policy-v7-12", lora_int_id=12, lora_path=".../policy-v7-12")

one name, id and folder per load, never reused (the serial, 12, counts loads). Why: vLLM
keys its prefix cache by the adapter's name and path (v1/core/kv_cache_utils.py,
`_gen_lora_extra_hash_keys`), so a name reused for newer adapters would hand a new request
keys/values computed under older ones (TRL names one adapter per policy version for this);
and it caches loaded adapters by id, so a reused id serves the old adapter silently (the
OpenPipe ART bug). The version alone would not do: a version number comes back when a
trainer resumes from an earlier checkpoint.

Kept: the current adapter and the older ones that requests still running were admitted
under, at most MAX_LIVE_ADAPTERS (vLLM's `max_loras` and `max_cpu_loras`); the others are
removed from vLLM and their folders deleted (`retire`), so memory stays bounded. The engine
decides which requests run under which adapter (generation/vllm_engine.py).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchtitan_rl.generation.vllm_support import vllm_lora_rank
from torchtitan_rl.models.lora import SCALE, Adapters, LoRAConfig, hf_module_name

logger = logging.getLogger(__name__)

MAX_LIVE_ADAPTERS = 3
"""Adapters vLLM holds at once (its `max_loras`, the adapters one batch may mix, and
`max_cpu_loras`): the current version and two older ones still finishing requests. A pull
past it moves the requests of the oldest onto the new version (vllm_engine.py)."""
VLLM_MODULES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "o_proj": "o_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
}
"""Hugging Face projection -> the vLLM Qwen3 module that computes it (its
`packed_modules_mapping` fuses q/k/v and gate/up; a fused module takes an adapter on any
of its parts, the others adding zero)."""
SHM = "/dev/shm"


SHM_MIN_FREE_BYTES = 1 << 30
"""/dev/shm is used only with this much free (a container's is often 64 MB)."""


def adapter_root(parent: str | None = None) -> str:
    """A new folder for one engine's adapters, named for this process: in /dev/shm when it
    is writable and has SHM_MIN_FREE_BYTES free, else the temp folder (`parent` overrides).
    First deletes the folders of processes that died without closing their engine."""
    if parent is None:
        usable = os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free >= SHM_MIN_FREE_BYTES
        parent = SHM if usable else tempfile.gettempdir()
    for path in glob.glob(os.path.join(parent, "vllm_lora_*_*")):
        pid = os.path.basename(path).split("_")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"vllm_lora_{os.getpid()}_", dir=parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def lora_engine_args(lora: LoRAConfig, engine_args_fields: set[str]) -> dict:
    """vLLM `EngineArgs` for serving `lora`'s adapters: LoRA on, rank rounded up to one
    vLLM allows, MAX_LIVE_ADAPTERS slots, LoRA layers only where `lora.target_modules` has
    adapters (where the release has `lora_target_modules`, in `engine_args_fields`)."""
    args = {
        "enable_lora": True,
        "max_lora_rank": vllm_lora_rank(lora.rank),
        "max_loras": MAX_LIVE_ADAPTERS,
        "max_cpu_loras": MAX_LIVE_ADAPTERS,
    }
    if "lora_target_modules" in engine_args_fields:
        args["lora_target_modules"] = sorted({VLLM_MODULES[t] for t in lora.target_modules})
    return args


def served_adapters(state: dict[str, torch.Tensor], version: int) -> Adapters:
    """A SERVE payload's adapters (torchtitan names: `layers.0.attention.wq.lora_A`, ...,
    and `lora.scale`) as `Adapters` under Hugging Face module names."""
    scale = float(state[SCALE])
    tensors = {}
    for name in (k.removesuffix(".lora_A") for k in state if k.endswith(".lora_A")):
        tensors[hf_module_name(name)] = (state[f"{name}.lora_A"], state[f"{name}.lora_B"])
    rank = next(iter(tensors.values()))[0].shape[0]
    return Adapters(version=version, rank=rank, alpha=scale * rank, tensors=tensors)


def split_adapters(state) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(adapters with the scale, every other weight) of a state `load_weights` queued."""
    adapters, weights = {}, {}
    for name in state:
        is_adapter = name == SCALE or name.endswith((".lora_A", ".lora_B"))
        (adapters if is_adapter else weights)[name] = state[name]
    return adapters, weights


def names_in_lora_layers(model) -> Callable[[str], str]:
    """Hugging Face weight name -> the name a reload reaches it by in `model` (vLLM's model
    built with LoRA). vLLM wraps each layer it serves LoRA on, the layer's own weight then
    being `<layer>.base_layer.<param>`. A wrapper with a `load_weights` of its own (vLLM
    0.32) loads the plain name into its base layer; one without (0.26: "no module or
    parameter named '...qkv_proj.weight'") needs the name to point there. A layer fused from
    several (q/k/v into qkv_proj: the model's `packed_modules_mapping`) keeps its own name
    before `.base_layer.`, so the loader's stacking maps the prefix as before."""
    wrapped = {
        name
        for name, module in model.named_modules()
        if isinstance(getattr(module, "_modules", {}).get("base_layer"), torch.nn.Module)
        and not callable(getattr(type(module), "load_weights", None))
    }
    fused = {
        part: whole
        for whole, parts in getattr(model, "packed_modules_mapping", {}).items()
        for part in parts
    }

    def rename(name: str) -> str:
        layer, _, param = name.rpartition(".")
        parent, _, leaf = layer.rpartition(".")
        module = fused.get(leaf, leaf)
        if (f"{parent}.{module}" if parent else module) in wrapped:
            return f"{layer}.base_layer.{param}"
        return name

    return rename


@dataclass(frozen=True, slots=True)
class Adapter:
    """One load of one version's adapters, as vLLM knows it."""

    version: int
    """The policy version the adapters are (what tokens sampled under them carry)."""
    request: object
    """vLLM's `LoRARequest` (name, id, folder) that requests are admitted with."""

    @property
    def id(self) -> int:
        return self.request.lora_int_id


class AdapterSet:
    """The adapters registered with one vLLM engine (module docstring)."""

    def __init__(self, llm, request_class, *, base: str, dtype: torch.dtype):
        """`llm`: vLLM's `LLMEngine`; `request_class`: its `LoRARequest`; `base`: the
        Hugging Face folder vLLM started from (named in adapter_config.json); `dtype`: what
        the folders hold (vLLM's LoRA dtype, its model's)."""
        self._llm = llm
        self._request_class = request_class
        self._base = base
        self._dtype = dtype
        self.root = adapter_root()
        """This engine's adapter folders (deleted at `close`)."""
        self.current: Adapter | None = None
        """What requests admitted now are served with (None: the weights alone)."""
        self.live: dict[int, Adapter] = {}
        """Registered with vLLM, by id."""
        self._serial = 0
        self.last_load = {"bytes": 0, "write_s": 0.0, "add_s": 0.0}
        """The last `add`: bytes of its folder, seconds writing it and registering it."""

    def prepare(self, state: dict[str, torch.Tensor], version: int) -> Adapter:
        """Writes `state`'s adapters (`split_adapters`) as a PEFT folder of their own; the
        adapter to `add` once the engine has made room."""
        from safetensors.torch import save_file

        from torchtitan_rl.models.peft_export import adapter_config, peft_state

        t0 = time.perf_counter()
        self._serial += 1
        name = f"policy-v{version}-{self._serial}"
        folder = os.path.join(self.root, name)
        os.makedirs(folder)
        adapters = served_adapters(state, version)
        tensors = peft_state(adapters, self._dtype)
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(adapter_config(adapters, self._base), f)
        self.last_load = {
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "write_s": time.perf_counter() - t0,
            "add_s": 0.0,
        }
        return Adapter(version, self._request_class(name, self._serial, folder))

    def add(self, adapter: Adapter) -> None:
        """Registers `adapter` with vLLM (it loads the folder now) and makes it current."""
        assert len(self.live) < MAX_LIVE_ADAPTERS, "retire before adding"
        t0 = time.perf_counter()
        if not self._llm.add_lora(adapter.request):
            raise RuntimeError(f"vLLM refused LoRA adapter {adapter.request.lora_name}")
        self.last_load["add_s"] = time.perf_counter() - t0
        self.live[adapter.id] = adapter
        self.current = adapter

    def clear_current(self) -> None:
        """Requests admitted from now on run on the weights alone (full weights arrived)."""
        self.current = None

    def retire(self, keep: set[int]) -> None:
        """Removes from vLLM, and deletes the folder of, every adapter but the current one
        and those whose id is in `keep` (adapters requests still run under)."""
        keep = keep | ({self.current.id} if self.current is not None else set())
        for adapter_id in [i for i in self.live if i not in keep]:
            adapter = self.live.pop(adapter_id)
            self._llm.remove_lora(adapter_id)
            shutil.rmtree(adapter.request.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
