"""The train/validation split every generated environment shares: decided by content.

A sample belongs to validation when a hash of its content (what makes two samples the same
question) falls in one bucket of `VALIDATION_ONE_IN`, so no question is ever in both sets,
whatever the seed or index. Sample `index` of a split is drawn from its own random stream,
`random.Random(f"{name}/{split}/{seed}/{index}")`, redrawn until it lands on its split:

    split_sample("countdown", seed=0, split="train", index=5, draw=..., content=...)
      -> draws from Random("countdown/train/0/5") until not is_validation(content(sample))
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from typing import Any, Literal, TypeVar

Split = Literal["train", "validation"]
_S = TypeVar("_S")

VALIDATION_ONE_IN = 8
"""One sample content in this many is held out for validation."""
MAX_DRAWS = 10_000
"""Redraws allowed to land a sample on its split; reaching it means a broken hash split,
or a pool of samples too small to hold one of this split."""


def is_validation(content: Any) -> bool:
    """Whether the JSON-serialisable `content` belongs to the validation set."""
    digest = hashlib.blake2b(json.dumps(content).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VALIDATION_ONE_IN == 0


def split_sample(
    name: str,
    *,
    seed: int,
    split: Split,
    index: int,
    draw: Callable[[random.Random], _S | None],
    content: Callable[[_S], Any],
) -> _S:
    """Sample `index` of `split`: `draw(rng)` (None: no sample, draw again) until the drawn
    sample's `content` is on `split`. RuntimeError after MAX_DRAWS draws."""
    rng = random.Random(f"{name}/{split}/{seed}/{index}")
    for _ in range(MAX_DRAWS):
        sample = draw(rng)
        if sample is not None and is_validation(content(sample)) == (split == "validation"):
            return sample
    raise RuntimeError(f"{name}: no {split} sample (index {index}) in {MAX_DRAWS} draws")
