"""A weight sync over a changing set of generators, with the actors' real endpoint code and
real gloo groups (each actor a bare instance whose calls run in a thread of their own, as in
a process of their own; the engine is a fake that records what it is given): a sync over 2
generators; one dies and the sync is abandoned without a word to it; a new sync over the
survivor delivers; then one over the survivor and a fresh replica delivers to both. The
abandoned sync cannot be used again. With "delta" the survivor keeps receiving deltas and
the fresh replica gets a full send."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchtitan_rl.actors.generator import GeneratorActor
from torchtitan_rl.actors.trainer import TrainerActor
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.models.lora import LoRAConfig
from torchtitan_rl.weight_sync.delta import DELTA, FULL
from torchtitan_rl.weight_sync.packing import sharded_state
from torchtitan_rl.weight_sync.sides import ReceivingSide, SendingSide
from torchtitan_rl.weight_sync.transport import WeightSync


class _Mesh:
    """One actor's endpoints: `call` (a mesh of one rank) and `call_one`. Each call runs in
    a thread of its own with its own event loop, so a blocking endpoint (forming a group,
    a send) blocks only itself, as it would in the actor's process."""

    def __init__(self, actor):
        self._actor = actor

    def __getattr__(self, name):
        method = type(self._actor).__dict__[name]._method
        method = getattr(method, "__wrapped__", method)  # a concurrent endpoint's own body
        actor = self._actor

        class _Endpoint:
            async def call_one(self, *args):
                return await asyncio.to_thread(asyncio.run, method(actor, *args))

            async def call(self, *args):
                return {0: await self.call_one(*args)}

        return _Endpoint()


class _Engine:
    def __init__(self):
        self.loaded: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.config = EngineConfig()

    def load_weights(self, state, version, partial=False):
        self.loaded.append((version, {k: v.clone() for k, v in state.items()}))


def _trainer() -> TrainerActor:
    actor = TrainerActor.__new__(TrainerActor)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 17), nn.LayerNorm(17))
    actor.rank = 0
    actor.core = SimpleNamespace(
        model=model, policy_version=1, device=torch.device("cpu"), lora=LoRAConfig(),
        sync_state=lambda merge=True: sharded_state(model),  # no [lora]: the weights as they are
    )  # fmt: skip
    actor.sync_side = SendingSide(actor.core.device)
    return actor


def _generator() -> GeneratorActor:
    actor = GeneratorActor.__new__(GeneratorActor)
    actor.engine, actor.device = _Engine(), torch.device("cpu")
    actor.sync_side = ReceivingSide(actor.device)
    actor.actor_name = "generator"
    return actor


def _step(trainer: TrainerActor, fraction: float) -> None:
    """An optimizer step moving about `fraction` of the weights."""
    with torch.no_grad():
        for p in trainer.core.model.parameters():
            p.add_((torch.rand(p.shape) < fraction) * 0.25)
    trainer.core.policy_version += 1


def _holds(generator: GeneratorActor, trainer: TrainerActor) -> bool:
    version, state = generator.engine.loaded[-1]
    want = trainer.core.model.state_dict()
    return version == trainer.core.policy_version and all(
        torch.equal(state[k], want[k]) for k in want
    )


@pytest.mark.parametrize("transport", ["delta", "broadcast", "controller"])
def test_a_new_sync_over_the_survivor_then_over_a_fresh_replica_delivers(transport):
    trainer, gens = _trainer(), [_generator(), _generator()]
    t, g = _Mesh(trainer), [_Mesh(x) for x in gens]

    async def run():
        modes = []
        sync = await WeightSync.create(t, g, "float32", transport)
        assert sync.transport == transport
        await sync()
        assert sync.version == 1 and _holds(gens[0], trainer) and _holds(gens[1], trainer)
        modes.append(getattr(trainer.sync_side.sender, "last", {}).get("mode"))
        # generator 1 dies: its side of the group goes (its sockets close with its process)
        gens[1].sync_side.close()
        await asyncio.wait_for(sync.close(), timeout=10)  # no word to the dead member
        _step(trainer, 0.1)
        survivor = await WeightSync.create(t, g[:1], "float32", transport)
        assert survivor.key != sync.key
        await survivor()
        assert _holds(gens[0], trainer) and gens[1].engine.loaded[-1][0] == 1
        modes.append(getattr(trainer.sync_side.sender, "last", {}).get("mode"))
        with pytest.raises(RuntimeError, match=f"weight sync {sync.key} is closed"):
            await sync()
        # a fresh replica replaces the dead one
        fresh = _generator()
        gens.append(fresh)
        await survivor.close()
        _step(trainer, 0.1)
        both = await WeightSync.create(t, [g[0], _Mesh(fresh)], "float32", transport)
        for _ in range(2):
            await both()
            assert _holds(gens[0], trainer) and _holds(fresh, trainer)
            modes.append(getattr(trainer.sync_side.sender, "last", {}).get("mode"))
            _step(trainer, 0.1)
        await both.close()
        return modes

    modes = asyncio.run(run())
    if transport == "delta":  # full (no bases); delta (the survivor's base); full; delta
        assert modes == [FULL, DELTA, FULL, DELTA]
    for actor in gens:
        actor.sync_side.close()
