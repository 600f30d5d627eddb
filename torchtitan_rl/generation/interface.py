"""The one interface the generator actor drives, whichever backend serves it."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from torchtitan_rl.types import Completion, SamplingParams


class GenerationEngine(Protocol):
    """Implemented by the native `Engine` and by `VllmEngine` (`generator.backend`)."""

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

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Queue full weights (torchtitan names); applied between engine steps."""

    async def close(self) -> None:
        """Fail outstanding requests and release the engine."""
