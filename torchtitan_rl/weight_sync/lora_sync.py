"""Adapter-only weight sync ([lora] on, an engine whose `adapter_use` is MERGE or SERVE:
generation/interface.py): what moves per step is the adapters, once the frozen base has moved.

A `WeightSync` moves one of three payloads, each an ordinary packed buffer (packing.py), so
every transport of strategies.py carries any of them unchanged:

    FULL      the merged weights W + scale * B @ A and every other weight, in the
              generator's dtype: no [lora], or an engine that takes full weights
              (`AdapterUse.FULL`: vLLM with lora.vllm_sync = "merged")
    BASE      the frozen base as the trainer holds it (unmerged, in its own dtype, every
              weight under the generator's names): once per generator
    ADAPTERS  every A and B in fp32, then the scale, e.g. rank r, dim D, q width Q:
              layout = [("layers.0.attention.wq.lora_A", (r, D), 0),
                        ("layers.0.attention.wq.lora_B", (Q, r), r*D), ...,
                        ("lora.scale", (), n - 1)]       # 4 bytes beyond the adapters

MERGE (the native engine): the generator merges each ADAPTERS payload into its weights
(`LoRABase.merge`) the way the trainer merges for a FULL sync (base in the trainer's dtype
-> fp32, + scale * (B @ A) in fp32, then the engine dtype), so its weights are bit for bit
what a FULL sync delivers (on the same device type; FSDP over several ranks merges row
blocks, which a BLAS may round differently). The engine loads the merges like any weights:
between engine steps, as a new version and a new KV epoch (`load_weights(..., partial=True)`).
Each merged weight is made when the engine reads it (`MergedWeights`), so the merges never
all exist at once.

SERVE (vLLM with lora.vllm_sync = "adapters"): the engine gets the adapters themselves
(`ServedBase`): the base's weights with the first adapters after a BASE, then each
version's A, B and scale alone; it serves each version as a LoRA adapter of its own
(generation/vllm_lora.py). Nothing of the base is kept here once the engine has it.

Who holds the base: the trainer's sending side draws a random id per process
(`SendingSide.base_id`); a generator keeps the id its BASE came with. Whenever a sync opens
(at start, and after each change of the set of generators) those whose id differs (fresh or
restarted replicas) first get a BASE sync of their own (transport.py).

Generator memory (MERGE), by `lora.generator_base`: the base arrives in host memory
(page-locked when the generator computes on a GPU: `HostCopy`). "host" keeps it there for
the run, and each sync copies the base of every adapted weight to the device, one weight at
a time, as it merges it (the 8B shape: 13.9 GB host to device per sync, no GPU memory kept;
docs/benchmarks.md, "Adapter-only weight sync"). "device" copies the adapted weights' base
to the device once, at the first merge, and lets the host copy go once the engine has
loaded the base's other weights: no copy per sync, the adapted weights once more on the
device. "auto" picks one at the first merge (`base_fits_on_device`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from enum import StrEnum

import torch

from torchtitan_rl.models.lora import SCALE, GeneratorBase
from torchtitan_rl.weight_sync.packing import PackedWeights, unpack_weights

NO_BASE = -1
"""A generator's base id while it holds none."""
FREE_SHARE = 0.5
"""`lora.generator_base = "auto"`: the most of the GPU's free memory the kept base may take;
a trainer sharing the GPU may not have reached its peak when the first merge looks."""
CAP_SHARE = 0.9
"""... and under `generator.gpu_memory_gib`, the most of the cap the generator's peak so far
and the kept base may fill together (room for prefill activations that peak has not seen)."""
MERGE_BYTES_PER_ELEMENT = 12
"""A merge's temporaries per element of its weight: the base, B @ A and their sum in fp32."""


def base_fits_on_device(need: int, *, free: int, cap: int, peak: int) -> bool:
    """`lora.generator_base = "auto"`: whether `need` bytes (the adapted weights' base and
    the largest merge's temporaries) may stay on the GPU for the run, given the GPU's free
    bytes now, the process's cap in bytes (0: none) and its peak reserved bytes so far.

    E.g. the 8B shape capped at 37.25 GiB (half an 80 GB GPU): 12.9 GiB of base on a 36 GiB
    peak does not fit (host); the 4B shape under a 37 GiB cap, 6.8 GiB on 22 GiB, does."""
    if need > FREE_SHARE * free:
        return False
    return not cap or peak + need <= CAP_SHARE * cap


class Payload(StrEnum):
    """What a weight sync moves (module docstring)."""

    FULL = "full"
    BASE = "base"
    ADAPTERS = "adapters"


def adapter_payload(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The ADAPTERS state from a model state dict with adapters (`sharded_state`: DTensor
    shards are fine, `gather_into` gathers them): every `.lora_A` / `.lora_B`, then the
    scale as a 0-d tensor."""
    out = {k: v for k, v in state.items() if k.endswith((".lora_A", ".lora_B"))}
    assert out, "no adapters in the state: is [lora] on?"
    device = next(iter(out.values())).device
    out[SCALE] = torch.tensor(scale, dtype=torch.float32, device=device)
    return out


class HostCopy:
    """`src_P` (a flat buffer of one's own: nothing writes it in place) in this process's
    host memory, for a process computing on `device`: the buffer itself when it is in host
    memory already, else a copy. For a GPU its pages are locked (cudaHostRegister), so
    host-to-device copies from it run at full speed and asynchronously; at its exact size,
    where torch's pinned allocator would round up to a power of two (13.9 GB -> 16 GiB)
    and keep the block. The pages are unlocked when this object goes, once the device has
    finished any copy from them."""

    def __init__(self, src_P: torch.Tensor, device: torch.device):
        on_host = src_P.device.type == "cpu"
        self.flat_P = src_P if on_host else torch.empty(src_P.shape, dtype=src_P.dtype)
        self.locked = device.type == "cuda" and self.flat_P.numel() > 0
        """Whether the pages are locked (tests)."""
        if self.locked:  # before the copy from a GPU, which then runs at full speed too
            _lock_pages(self.flat_P)
            unlock = weakref.finalize(self, _unlock_pages, self.flat_P.data_ptr(), device)
            unlock.atexit = False  # the process's pages go with it anyway
        if not on_host:
            self.flat_P.copy_(src_P)


def _lock_pages(host: torch.Tensor) -> None:
    nbytes = host.numel() * host.element_size()
    error = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {error}")


def _unlock_pages(ptr: int, device: torch.device) -> None:
    torch.cuda.synchronize(device)  # no copy from these pages may still be in flight
    torch.cuda.cudart().cudaHostUnregister(ptr)


class MergedWeights(Mapping[str, torch.Tensor]):
    """What the engine loads for one ADAPTERS payload, made as it is read: W = base + scale
    * B @ A in `dtype` for every adapted weight (its base copied from host memory to
    `device` right then, unless kept there), and for the first payload after a base the
    base's other weights
    as they are (host tensors, which the engine's copy moves and casts). The engine reads
    one name at a time and copies the weight into place before reading the next
    (`ModelRunner.load_state_dict`), so one weight's temporaries (the 8B shape's largest:
    ~0.8 GB) live on the device at a time, never every merge at once."""

    def __init__(
        self, host: HostCopy | None, bases: dict[str, torch.Tensor],
        adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float,
        dtype: torch.dtype, device: torch.device, others: dict[str, torch.Tensor],
    ):  # fmt: skip
        self._host = host  # the pages stay locked while a copy from them may be queued
        self._bases, self._adapters, self._others = bases, adapters, others
        self._scale, self._dtype, self._device = scale, dtype, device

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._others:
            return self._others[name]
        a, b = self._adapters[name]
        w = self._bases[name].to(self._device, non_blocking=True)
        # as models/lora.py `merged_weight`, so the result equals a FULL sync's bits
        return (w.float() + self._scale * (b.float() @ a.float())).to(self._dtype)

    def __iter__(self) -> Iterator[str]:
        yield from self._others
        yield from self._adapters

    def __len__(self) -> int:
        return len(self._others) + len(self._adapters)


class LoRABase:
    """A generator's copy of the frozen base (a BASE payload), and what it merges with each
    ADAPTERS payload; where it is kept: `placement` (module docstring)."""

    def __init__(
        self, base: PackedWeights, base_id: int, device: torch.device,
        placement: GeneratorBase = "auto", cap_bytes: int = 0,
    ):  # fmt: skip
        """`placement`: lora.generator_base; `cap_bytes`: generator.gpu_memory_gib in bytes
        (0: no cap), for "auto"."""
        self.base_id = base_id
        """The trainer's id of this base (`SendingSide.base_id`)."""
        self.device = torch.device(device)
        self.placement, self.cap_bytes = placement, cap_bytes
        self.host: HostCopy | None = HostCopy(base.flat_P, self.device)
        """The whole base in host memory (`base` may be freed once this is made: nothing
        here refers to it); for the run, or with the base on the device until the first
        merge (None after)."""
        host = PackedWeights(version=base.version, flat_P=self.host.flat_P, layout=base.layout)
        self.pending: dict[str, torch.Tensor] | None = unpack_weights(host)
        """Every base weight until the first merge hands the others to the engine; then
        None (only `adapted` is read from then on)."""
        self.adapted: dict[str, torch.Tensor] = {}
        """The base of each adapted weight by its name: views of `host`, or of one buffer
        on the device (`on_device`)."""
        self.on_device: bool | None = None
        """Whether `adapted` lives on the device (no copy per merge); None before the
        first merge decides it."""

    @torch.no_grad()
    def merge(self, adapters: PackedWeights, dtype: torch.dtype) -> tuple[MergedWeights, bool]:
        """(state, partial) for the engine's `load_weights`: W = base + scale * B @ A in
        `dtype` (the engine's) for every adapted weight, each made when the engine reads it
        (`MergedWeights`). The first merge after the base arrived is the full state (the
        base's other weights with it), later ones partial."""
        tensors = unpack_weights(adapters)
        scale = float(tensors.pop(SCALE))
        names = [k.removesuffix(".lora_A") for k in tensors if k.endswith(".lora_A")]
        pairs = {
            f"{n}.weight": (tensors[f"{n}.lora_A"].to(self.device),
                            tensors[f"{n}.lora_B"].to(self.device))
            for n in names
        }  # fmt: skip
        first = self.pending is not None
        others, host = {}, self.host
        if first:
            self.adapted = {w: self.pending[w] for w in pairs}
            others = {k: v for k, v in self.pending.items() if k not in pairs}
            self.pending = None
            self.on_device = self._keep_on_device()
            if self.on_device:  # this merge's state keeps the host copy until it is read
                self.adapted, self.host = _on_device(self.adapted, self.device), None
        elif set(pairs) != set(self.adapted):
            raise RuntimeError("the adapted weights changed since the base was received")
        merged = MergedWeights(host, self.adapted, pairs, scale, dtype, self.device, others)
        return merged, not first

    def _keep_on_device(self) -> bool:
        """`placement` for the adapted weights now in `adapted` (first merge)."""
        if self.placement != "auto" or self.device.type != "cuda":
            return self.placement != "host"
        largest = max(t.numel() for t in self.adapted.values())
        need = self.adapted_nbytes() + MERGE_BYTES_PER_ELEMENT * largest
        free, _ = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_reserved(self.device)
        return base_fits_on_device(need, free=free, cap=self.cap_bytes, peak=peak)

    def adapted_nbytes(self) -> int:
        """Bytes of the adapted weights' base: what a merge copies to the device when it is
        kept in host memory, or what the device holds for the run when not."""
        return sum(t.numel() * t.element_size() for t in self.adapted.values())

    def nbytes(self) -> int:
        """Bytes this copy of the base holds now: the host copy while there is one, plus
        the adapted weights' base on the device when it is kept there."""
        flat = self.host.flat_P if self.host is not None else None
        host = 0 if flat is None else flat.numel() * flat.element_size()
        return host + (self.adapted_nbytes() if self.on_device else 0)


def _on_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """`tensors` (one dtype) copied into one buffer of their own on `device`, by name: a
    single allocation, so the kept base leaves no fragments behind."""
    (dtype,) = {t.dtype for t in tensors.values()}
    flat = torch.empty(sum(t.numel() for t in tensors.values()), dtype=dtype, device=device)
    out, start = {}, 0
    for name, t in tensors.items():
        out[name] = flat[start : start + t.numel()].view(t.shape)
        out[name].copy_(t, non_blocking=True)  # from page-locked memory: queued, not waited
        start += t.numel()
    return out


class ServedBase:
    """`AdapterUse.SERVE`: a base (a BASE payload) in host memory until the engine loads it
    with the first adapters after it; from then on each ADAPTERS payload goes to the engine
    as it is, and nothing of the base is kept here."""

    def __init__(self, base: PackedWeights, base_id: int):
        self.base_id = base_id
        """The trainer's id of this base (`SendingSide.base_id`)."""
        host = HostCopy(base.flat_P, torch.device("cpu"))  # read once: no page lock
        packed = PackedWeights(version=base.version, flat_P=host.flat_P, layout=base.layout)
        self.pending: dict[str, torch.Tensor] | None = unpack_weights(packed)
        """The base's weights until the first adapters take them to the engine; then None."""

    def adapters(self, adapters: PackedWeights) -> tuple[dict[str, torch.Tensor], bool]:
        """(state, partial) for the engine's `load_weights`: the payload's `*.lora_A`,
        `*.lora_B` and `lora.scale` (SCALE), with the base's weights the first time (not
        partial), alone afterwards (partial)."""
        tensors = unpack_weights(adapters)
        if self.pending is None:
            return tensors, True
        state, self.pending = {**self.pending, **tensors}, None
        return state, False
