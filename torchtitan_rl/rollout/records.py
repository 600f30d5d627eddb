"""Rollout records: for each trained group of a step, its best and worst rollout as JSON lines
under <run_dir>/rollouts/step_<N>.jsonl, for reading what the policy actually does.

One line (one rollout), abridged:
    {"step": 3, "group_id": 0, "pick": "best", "rollout_id": 5, "status": "completed",
     "error": null, "scorer_error": null, "reward": 0.81, "reward_breakdown": {"sort_score": 0.81},
     "advantage": 0.32, "group_rewards": [0.81, 0.2, ...], "policy_version_min": 2,
     "policy_version_max": 2, "sample": {...},
     "messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...],
     "turns": [{"turn": 0, "assistant": "...", "env_messages": [...], "finish_reason": "stop",
                "num_tokens": 14, "policy_version_min": 2, "policy_version_max": 2,
                "reward_signals": {"turn_score": 0.81}}]}

`pick` is "best" (highest reward), "worst" (an error if the group has one, else the lowest
reward), or "best+worst" when the group has one distinct rollout to show; groups filtered out
of training (no reward spread) appear only when they hold an error, as "filtered-error".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torchtitan_rl.types import Rollout, RolloutGroup


def _rank(rollout: Rollout) -> tuple[int, float]:
    """Errors below every valid reward; higher is better."""
    return (0, 0.0) if rollout.status.is_error() else (1, rollout.reward)


def best_and_worst(group: RolloutGroup) -> list[tuple[str, Rollout]]:
    if not group.rollouts:
        return []
    best = max(group.rollouts, key=_rank)
    worst = min(group.rollouts, key=_rank)
    if worst is best:
        return [("best+worst", best)]
    return [("best", best), ("worst", worst)]


def rollout_record(
    rollout: Rollout, *, step: int, pick: str, group: RolloutGroup
) -> dict[str, Any]:
    completions = [t.completion for t in rollout.turns]
    return {
        "step": step,
        "group_id": rollout.group_id,
        "sample_index": group.sample_index,
        "pick": pick,
        "rollout_id": rollout.rollout_id,
        "session_id": rollout.session_id,
        "status": rollout.status.value,
        "error": rollout.error,
        "scorer_error": rollout.scorer_error,
        "reward": rollout.reward,
        "reward_breakdown": rollout.reward_breakdown,
        "advantage": rollout.advantage,
        "group_rewards": [None if r.status.is_error() else r.reward for r in group.rollouts],
        "policy_version_min": min((c.policy_version_min for c in completions), default=None),
        "policy_version_max": max((c.policy_version_max for c in completions), default=None),
        "sample": rollout.sample,
        "messages": rollout.messages,
        "turns": [
            {
                "turn": i,
                "assistant": t.assistant_text,
                "env_messages": t.env_messages,
                "finish_reason": t.completion.finish_reason.value,
                "num_tokens": t.completion.num_tokens,
                "policy_version_min": t.completion.policy_version_min,
                "policy_version_max": t.completion.policy_version_max,
                "reward_signals": t.reward_signals,
            }
            for i, t in enumerate(rollout.turns)
        ],
    }


def write_step_records(
    folder: Path, step: int, groups: list[RolloutGroup], filtered: list[RolloutGroup] = ()
) -> Path:
    """Write (or overwrite, after a resume) step_<step>.jsonl; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w") as f:
        for group in groups:
            for pick, rollout in best_and_worst(group):
                record = rollout_record(rollout, step=step, pick=pick, group=group)
                f.write(json.dumps(record, default=str) + "\n")
        for group in filtered:
            errored = [r for r in group.rollouts if r.status.is_error()]
            if errored:
                record = rollout_record(errored[0], step=step, pick="filtered-error", group=group)
                f.write(json.dumps(record, default=str) + "\n")
    tmp.replace(path)
    return path


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
