"""Supervised warm start: gold env conversations as episodes whose loss covers the answers."""

from __future__ import annotations

from typing import Any

import numpy as np

from torchtitan_rl.envs.base import Environment
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.types import Episode


def demonstration_episodes(
    environment: Environment, renderer: Renderer, samples: list[dict[str, Any]]
) -> list[Episode]:
    """One episode per sample: the whole gold conversation, loss on assistant tokens."""
    episodes = []
    for i, sample in enumerate(samples):
        ids_L, mask_L = renderer.render_demonstration(environment.demonstration(sample))
        zeros = np.zeros(len(ids_L), np.float32)
        episodes.append(
            Episode(
                token_ids_L=ids_L.astype(np.int32),
                loss_mask_L=mask_L.astype(bool),
                logprobs_L=zeros,
                advantages_L=zeros,
                rollout_id=i,
            )
        )
    return episodes
