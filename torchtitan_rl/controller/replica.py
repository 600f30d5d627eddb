"""A generator replica's names and state, as the fleet keeps them (controller/fleet.py).

replica_name(1) == "generator1"; replica_name(1, 2) == "generator1_r2" (its 2nd restart)
parse_replica_name("generator1_r2") == (1, 2)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torchtitan_rl.actors.generate_fn import ActorGenerateFn

_REPLICA_NAME = re.compile(r"generator(\d*)(?:_r(\d+))?")


def replica_name(index: int, incarnation: int = 0) -> str:
    """The actor name of replica `index`: generator, generator1, ...; restarts add _r<k>."""
    base = "generator" if index == 0 else f"generator{index}"
    return base if incarnation == 0 else f"{base}_r{incarnation}"


@dataclass(kw_only=True, slots=True)
class Replica:
    """One generator replica: its current actor and how it stands."""

    index: int
    name: str
    actor: object
    fn: ActorGenerateFn
    incarnation: int = 0
    up: bool = True
    """Takes calls and receives weights."""
    joining: bool = False
    """A restarted process ready for weights; takes calls after the next sync."""
    down_since: float = 0.0


def parse_replica_name(name: str) -> tuple[int, int] | None:
    """(replica index, incarnation) of a name `replica_name` gives; None for another name."""
    found = _REPLICA_NAME.fullmatch(name)
    if found is None:
        return None
    return int(found.group(1) or 0), int(found.group(2) or 0)
