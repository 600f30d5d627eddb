"""Adapter-only weight sync ([lora] on, a backend whose row has `adapter_sync`): what moves
per step is the adapters, once the frozen base has moved.

A `WeightSync` moves one of three payloads, each an ordinary packed buffer (packing.py), so
every transport of strategies.py carries any of them unchanged:

    FULL      the merged weights W + scale * B @ A and every other weight, in the
              generator's dtype: no [lora], or a backend that takes full weights (vLLM)
    BASE      the frozen base as the trainer holds it (unmerged, in its own dtype, every
              weight under the generator's names): once per generator, kept, not served
    ADAPTERS  every A and B in fp32, then the scale, e.g. rank r, dim D, q width Q:
              layout = [("layers.0.attention.wq.lora_A", (r, D), 0),
                        ("layers.0.attention.wq.lora_B", (Q, r), r*D), ...,
                        ("lora.scale", (), n - 1)]       # 4 bytes beyond the adapters

The generator merges each ADAPTERS payload into its weights (`LoRABase.merge`) the way the
trainer merges for a FULL sync (base in the trainer's dtype -> fp32, + scale * (B @ A) in
fp32, then the engine dtype), so its weights are bit for bit what a FULL sync delivers (on
the same device type; FSDP over several ranks merges row blocks, which a BLAS may round
differently). The engine loads the merges like any weights: between engine steps, as a
new version and a new KV epoch (`load_weights(..., partial=True)`).

Who holds the base: the trainer's sending side draws a random id per process
(`SendingSide.base_id`); a generator keeps the id its BASE came with. Whenever a sync opens
(at start, and after each change of the set of generators) those whose id differs (fresh or
restarted replicas) first get a BASE sync of their own (transport.py).

Generator memory: the base of every adapted weight, in the trainer's dtype, for the run
(docs/benchmarks.md, "Adapter-only weight sync").
"""

from __future__ import annotations

from enum import StrEnum

import torch

from torchtitan_rl.weight_sync.packing import PackedWeights, unpack_weights

SCALE = "lora.scale"
"""The layout name of the adapter scale (alpha / rank) in an ADAPTERS payload."""
NO_BASE = -1
"""A generator's base id while it holds none."""


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


class LoRABase:
    """A generator's copy of the frozen base (a BASE payload) and what it merges with
    each ADAPTERS payload."""

    def __init__(self, base: PackedWeights, base_id: int, device: torch.device):
        self.base_id = base_id
        """The trainer's id of this base (`SendingSide.base_id`)."""
        self.device = device
        self.pending: dict[str, torch.Tensor] | None = unpack_weights(base)
        """Every base weight until the first merge hands them to the engine; then None (the
        buffer is freed, only `adapted` stays)."""
        self.adapted: dict[str, torch.Tensor] = {}
        """The base of each adapted weight by its name, on `device`, in the trainer's dtype."""

    @torch.no_grad()
    def merge(
        self, adapters: PackedWeights, dtype: torch.dtype
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """(state, partial) for the engine's `load_weights`: W = base + scale * B @ A in
        `dtype` (the engine's) for every adapted weight. The first merge after the base
        arrived is the full state (the base's other weights with it), later ones partial."""
        tensors = unpack_weights(adapters)
        scale = float(tensors.pop(SCALE))
        names = [k.removesuffix(".lora_A") for k in tensors if k.endswith(".lora_A")]
        weights = [f"{name}.weight" for name in names]
        first = self.pending is not None
        if first:
            self.adapted = {w: self.pending[w].to(self.device, copy=True) for w in weights}
        elif set(weights) != set(self.adapted):
            raise RuntimeError("the adapted weights changed since the base was received")
        state = {}
        for name, weight in zip(names, weights):
            a = tensors[f"{name}.lora_A"].to(self.device)
            b = tensors[f"{name}.lora_B"].to(self.device)
            # as models/lora.py `merged_weight`, so the result equals a FULL sync's bits
            state[weight] = (self.adapted[weight].float() + scale * (b.float() @ a.float())).to(
                dtype
            )
        if first:
            state, self.pending = {**self.pending, **state}, None
        return state, not first

    def nbytes(self) -> int:
        """Bytes this copy of the base holds for the run (the adapted weights' base)."""
        return sum(t.numel() * t.element_size() for t in self.adapted.values())
