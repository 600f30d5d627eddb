"""A finished verifiers episode as our Rollout: the trained agent's turns, status and reward.

The rollout trains on the episode's one trainable trace (verifiers' `trace.agent.trainable`;
a simulated user or judge the Env marks untrainable generates too, but is not trained on):
its turns are the ones our client served for that trace, prompt ids and completions as
generated, and its messages are the trace's conversation. The trace's rewards land on the
last turn's `reward_signals`, and the rubric reads verifiers' weighted sum back:

    reward_signals = {"verifiers_reward": 0.8,           # trace.reward, the weighted sum
                      "reward/exact": 1.0, "reward/format": 0.6,   # each @reward's score
                      "metric/num_words": 3.0}           # each @metric

Status: a failed episode or trace (any agent's: verifiers then fails the episode) is an
error (a raising @reward or Env.finalize is ERROR_REWARD, a failed generation
ERROR_GENERATOR, anything else ERROR_ENV, a deadline ERROR_TIMEOUT, each with verifiers'
error line); a trace stopped by a limit is truncated (max_turns: TRUNCATED_TURNS, token
limits: TRUNCATED_PROMPT); a last completion cut at max_tokens is TRUNCATED_LENGTH; anything
else COMPLETED.
"""

from __future__ import annotations

from typing import Any

from verifiers.v1.types import content_text

from torchtitan_rl.envs.verifiers_client import GenerateFnClient
from torchtitan_rl.types import FinishReason, Rollout, RolloutStatus

REWARD = "verifiers_reward"
"""The rubric's one function: the trained trace's reward as verifiers sums it."""
TRUNCATING_STOPS = {
    "max_turns": RolloutStatus.TRUNCATED_TURNS,
    "max_input_tokens": RolloutStatus.TRUNCATED_PROMPT,
    "max_output_tokens": RolloutStatus.TRUNCATED_PROMPT,
    "max_total_tokens": RolloutStatus.TRUNCATED_PROMPT,
}
"""verifiers' limit stops (`RolloutLimits`) as our truncated statuses."""


def verifiers_reward(rollout: Rollout) -> float:
    return rollout.turns[-1].reward_signals[REWARD]


def fill_rollout(rollout: Rollout, episode: Any, client: GenerateFnClient) -> None:
    """Set `rollout`'s turns, messages and status (and its error) from `episode`."""
    trained = [t for t in episode.traces if t.agent.trainable]
    if len(trained) == 1:
        trace = trained[0]
        rollout.turns = client.turns(trace.id)
        rollout.messages = [
            {"role": m.role, "content": content_text(m.content)} for m in trace.messages
        ]
    if episode.errors:
        error = episode.errors[-1]
        if episode.is_timeout:
            status = RolloutStatus.ERROR_TIMEOUT
        elif ".finalize()" in error.message:  # Env.finalize: the cross-agent judgement
            status = RolloutStatus.ERROR_REWARD
        else:
            status = RolloutStatus.ERROR_ENV
        return _fail(rollout, status, error)
    failed = [t for t in episode.traces if not t.ok]  # verifiers fails the episode with any
    if failed:
        first = next((t for t in failed if t.agent.trainable), failed[0])
        where = "" if first.agent.trainable else f"agent {first.agent.name!r}: "
        return _fail(rollout, _failure_status(first), first.last_error, where)
    if len(trained) != 1:
        names = [t.agent.name for t in trained]
        rollout.status = RolloutStatus.ERROR_ENV
        rollout.error = f"the episode has {len(trained)} trainable traces {names}; one is trained"
        return None
    if trace.is_timeout:
        rollout.status = RolloutStatus.ERROR_TIMEOUT
        rollout.error = f"verifiers stopped the episode: {trace.stop_condition}"
        return None
    if not rollout.turns:
        rollout.status = RolloutStatus.ERROR_ENV
        rollout.error = "the episode ended before the trained agent's first turn"
        return None
    if len(rollout.turns) != trace.num_turns:  # a turn generated but not kept (or the reverse)
        rollout.status = RolloutStatus.ERROR_ENV
        rollout.error = (
            f"verifiers kept {trace.num_turns} turns of the {len(rollout.turns)} generated "
            "for the trained agent"
        )
        return None
    rollout.status = _finished_status(rollout, trace.stop_condition)
    signals = {REWARD: float(trace.reward)}
    signals |= {f"reward/{k}": float(r.score) for k, r in trace.rewards.items() if r is not None}
    signals |= {f"metric/{k}": float(v) for k, v in trace.metrics.items() if v is not None}
    rollout.turns[-1].reward_signals = signals
    return None


def _failure_status(trace: Any) -> RolloutStatus:
    kind = trace.last_error.type if trace.last_error else ""
    if kind == "TaskError" and trace.timing.scoring.start:  # a @reward or @metric raised
        return RolloutStatus.ERROR_REWARD
    if kind == "ProviderError":  # our generator (or a role's own endpoint) failed
        return RolloutStatus.ERROR_GENERATOR
    return RolloutStatus.ERROR_ENV


def _finished_status(rollout: Rollout, stop: str | None) -> RolloutStatus:
    if stop in TRUNCATING_STOPS:
        return TRUNCATING_STOPS[stop]
    if rollout.turns[-1].completion.finish_reason == FinishReason.LENGTH:
        return RolloutStatus.TRUNCATED_LENGTH
    return RolloutStatus.COMPLETED


def _fail(rollout: Rollout, status: RolloutStatus, error: Any, where: str = "") -> None:
    """An error status with verifiers' error (a `trace.Error`) as its line and details."""
    rollout.status = status
    if error is None:
        rollout.error = f"{where}the verifiers episode failed without an error"
        return
    lines = error.message.strip().splitlines() or [""]
    rollout.error = f"{where}{error.type}: {lines[0]}"
    rollout.error_details = error.traceback or (error.message if len(lines) > 1 else None)
