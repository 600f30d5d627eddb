"""Prefix packing: a multi-turn rollout becomes one token sequence per history branch.

TokenEnv builds each turn's prompt by appending to the last one, so normally
    prompt_1 = P0 + A0 + E0,  prompt_2 = P0 + A0 + E0 + A1 + E1
and the whole rollout packs into a single episode:
    token_ids_L  = P0 + A0 + E0 + A1 + E1 + A2
    loss_mask_L  = [0]*len(P0) + [1]*len(A0) + [0]*len(E0) + [1]*len(A1) + [0]*len(E1) + [1]*len(A2)
If a turn's prompt does not start with the running sequence (the env rewrote history, e.g.
dropped old reasoning), the current episode is closed and a new branch starts from that
turn's full prompt (all of it loss_mask 0).

Advantages are the rollout's scalar advantage on every assistant token; generator log-probs
are copied token by token. Error rollouts produce no episodes; an episode with no assistant
token is dropped (nothing to train on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchtitan_rl.envs.base import Environment
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.types import Completion, Episode, Rollout

_INT32_MAX = np.iinfo(np.int32).max


@dataclass(slots=True)
class _Branch:
    """Segments of one episode under construction (concatenated once, at the end)."""

    token_ids: list[np.ndarray] = field(default_factory=list)
    is_assistant: list[bool] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    running_L: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    def append(self, ids: np.ndarray, completion: Completion | None) -> None:
        ids = np.asarray(ids, dtype=np.int32)
        self.token_ids.append(ids)
        self.is_assistant.append(completion is not None)
        if completion is not None:
            assert completion.logprobs_N.shape[0] == ids.shape[0], (
                "one logprob per completion token"
            )
            self.completions.append(completion)
        self.running_L = np.concatenate([self.running_L, ids])


def rollout_to_episodes(rollout: Rollout) -> list[Episode]:
    """One Episode per branch of `rollout`'s history, in turn order."""
    if rollout.status.is_error() or not rollout.turns:
        return []
    branches: list[_Branch] = []
    branch: _Branch | None = None
    for turn in rollout.turns:
        prompt = np.asarray(turn.prompt_ids, dtype=np.int32)
        if branch is not None and _starts_with(prompt, branch.running_L):
            branch.append(prompt[branch.running_L.shape[0] :], None)
        else:
            branch = _Branch()
            branches.append(branch)
            branch.append(prompt, None)
        branch.append(turn.completion.token_ids_N, turn.completion)
    episodes = [_to_episode(b, rollout, index) for index, b in enumerate(branches)]
    return [e for e in episodes if e.loss_mask_L.any()]


def _starts_with(seq: np.ndarray, prefix: np.ndarray) -> bool:
    n = prefix.shape[0]
    return seq.shape[0] >= n and bool(np.array_equal(seq[:n], prefix))


def _to_episode(branch: _Branch, rollout: Rollout, index: int) -> Episode:
    token_ids_L = branch.running_L
    loss_mask_L = np.concatenate(
        [
            np.full(ids.shape[0], a, dtype=bool)
            for ids, a in zip(branch.token_ids, branch.is_assistant)
        ]
    )
    logprobs_L = np.zeros(token_ids_L.shape[0], dtype=np.float32)
    logprobs_L[loss_mask_L] = np.concatenate(
        [np.asarray(c.logprobs_N, dtype=np.float32) for c in branch.completions]
    )
    advantages_L = np.where(loss_mask_L, np.float32(rollout.advantage), np.float32(0.0))
    support_ids, support_offsets = _concat_support(branch.completions)
    return Episode(
        token_ids_L=token_ids_L,
        loss_mask_L=loss_mask_L,
        logprobs_L=logprobs_L,
        advantages_L=advantages_L.astype(np.float32),
        group_id=rollout.group_id,
        rollout_id=rollout.rollout_id,
        branch=index,
        policy_version_min=min(c.policy_version_min for c in branch.completions),
        policy_version_max=max(c.policy_version_max for c in branch.completions),
        support_ids=support_ids,
        support_offsets=support_offsets,
    )


def _concat_support(
    completions: list[Completion],
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Concatenate per-completion support CSR over the episode's loss tokens, in order."""
    has = [c.support_offsets is not None and c.support_ids is not None for c in completions]
    if not any(has):
        return None, None
    assert all(has), "some completions of one rollout carry sampling support and some do not"
    ids_parts: list[np.ndarray] = []
    offset_parts = [np.zeros(1, dtype=np.int64)]
    base = 0
    for c in completions:
        offsets = np.asarray(c.support_offsets, dtype=np.int64)
        assert offsets.shape[0] == c.num_tokens + 1, "support_offsets must have N + 1 entries"
        ids_parts.append(np.asarray(c.support_ids, dtype=np.int32)[offsets[0] : offsets[-1]])
        offset_parts.append(offsets[1:] - offsets[0] + base)
        base += int(offsets[-1] - offsets[0])
    assert base <= _INT32_MAX, "support CSR too large for int32 offsets"
    return np.concatenate(ids_parts), np.concatenate(offset_parts).astype(np.int32)


def count_branches(rollout: Rollout) -> int:
    """len(rollout_to_episodes(rollout)), without building the episodes."""
    branches, running_L = 0, None
    for turn in rollout.turns:
        if running_L is None or not _starts_with(turn.prompt_ids, running_L):
            branches += 1
        running_L = np.concatenate([turn.prompt_ids, turn.completion.token_ids_N])
    return branches


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


def longest_run(mask_L: np.ndarray) -> int:
    """Length of the longest run of true values: a demonstration's longest assistant turn."""
    padded = np.concatenate([[0], np.asarray(mask_L, dtype=np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return int((edges[1::2] - edges[::2]).max(initial=0))
