"""What a person running the job must hear: rollout errors with their text, and runs that
train on nothing useful. Everything goes through `logging` (the CLI writes warnings above
the progress bar), once per error kind per step, or once per run for a degenerate setting.

    step 3: 16 of 16 rollouts error_reward, first: KeyError: 'turn_score'
            (tracebacks in outputs/run/errors.log)
    step 5: 92% of rollouts ended truncated_turns: env.max_turns=1 ends rollouts before the
            environment says done; raise env.max_turns
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.types import Rollout, RolloutGroup, RolloutStatus, every_rollout_errored

logger = logging.getLogger(__name__)

DEGENERATE_SHARE = 0.5
"""Warn once a step's share of rollouts ending one degenerate way reaches this."""


def _truncation_hint(status: RolloutStatus, env: EnvConfig, max_tokens: int) -> str:
    if status is RolloutStatus.TRUNCATED_TURNS:
        return (
            f"env.max_turns={env.max_turns} ends rollouts before the environment says done; "
            "raise env.max_turns"
        )
    if status is RolloutStatus.TRUNCATED_LENGTH:
        return (
            f"completions hit rollout.max_tokens={max_tokens} (or env.max_rollout_tokens="
            f"{env.max_rollout_tokens}) before a stop token; raise them"
        )
    return (
        f"the next prompt would not fit env.max_rollout_tokens={env.max_rollout_tokens}; raise it"
    )


SCORER_RAISED = "scorer_raised"
"""A reward function raised `WrongAnswer`: the rollout scored 0 and trains (not an error)."""


class RunCannotLearn(RuntimeError):
    """Every rollout errored for rollout.max_error_steps steps in a row; the message is the
    one line shown."""

    needs_no_traceback = True


class StepDiagnostics:
    def __init__(
        self, run_dir: Path, env: EnvConfig, max_tokens: int, max_error_steps: int = 0,
        *, max_staleness: int = 0,
    ):  # fmt: skip
        """`max_error_steps`: raise RunCannotLearn after this many consecutive training steps
        whose rollouts all errored (0: never); `max_staleness`: rollout.max_staleness, named
        when a step's groups were all too stale."""
        self.errors_log = run_dir / "errors.log"
        self.env = env
        self.max_tokens = max_tokens
        self.max_error_steps = max_error_steps
        self.max_staleness = max_staleness
        self._warned: set[RolloutStatus | str] = set()
        """Degenerate statuses and reasons already announced (each once per run)."""
        self._error_steps = 0
        """Consecutive training steps so far in which every rollout errored."""

    def report(self, step: int, groups: list[RolloutGroup], *, training: bool = True) -> None:
        """Every rollout sampled in `step`, trained on or filtered out; `training=False`
        (validation) reports errors only: greedy validation truncates by its own limits."""
        rollouts = [r for g in groups for r in g.rollouts]
        if not rollouts:
            return
        counts = Counter(r.status for r in rollouts)
        first: dict[RolloutStatus, Rollout] = {}
        for rollout in rollouts:
            first.setdefault(rollout.status, rollout)
        errored = [r for r in rollouts if r.status.is_error()]
        if errored:
            self._log_tracebacks(step, errored)
        raised = [r for r in rollouts if r.scorer_error is not None]
        if training and raised:
            self._report_scorer_raised(step, raised, len(rollouts))
        for status, rollout in first.items():
            share = counts[status] / len(rollouts)
            if status.is_error():
                where = f" (tracebacks in {self.errors_log})" if rollout.error_details else ""
                logger.warning(
                    "step %d: %d of %d rollouts %s, first: %s%s",
                    step, counts[status], len(rollouts), status.value, rollout.error, where,
                )  # fmt: skip
            elif training and status.is_truncated() and share >= DEGENERATE_SHARE:
                if status not in self._warned:
                    self._warned.add(status)
                    logger.warning(
                        "step %d: %.0f%% of rollouts ended %s: %s",
                        step, 100 * share, status.value,
                        _truncation_hint(status, self.env, self.max_tokens),
                    )  # fmt: skip
        if training:
            self._count_error_steps(step, errored, raised, len(rollouts))

    def _report_scorer_raised(self, step: int, raised: list[Rollout], total: int) -> None:
        """Rollouts scored 0 because their scorer raised `WrongAnswer`: said the first time,
        and at every step where it hit every rollout (such steps count as error steps)."""
        if len(raised) < total and SCORER_RAISED in self._warned:
            return
        self._warned.add(SCORER_RAISED)
        if len(raised) < total:
            what = f"{len(raised)} of {total} rollouts", "a wrong answer, trained on"
        else:
            n = self.max_error_steps
            stops = f"rollout.max_error_steps={n} such steps in a row stop the run"
            what = f"all {total} rollouts", stops if n else "nothing to learn from"
        logger.warning(
            "step %d: %s scored 0 because the scorer raised on the reply (%s; counted in "
            "rollout/scorer_raised), first: %s", step, *what, raised[0].scorer_error,
        )  # fmt: skip

    def _count_error_steps(
        self, step: int, errored: list[Rollout], raised: list[Rollout], total: int
    ) -> None:
        """A step counts when every rollout errored or its scorer raised: all scored 0 at
        best, so nothing to learn from, and a scorer that always raises stops the run."""
        self._error_steps = self._error_steps + 1 if len(errored) + len(raised) == total else 0
        n = self.max_error_steps
        if n and self._error_steps >= n:
            kinds = sorted(
                {r.status.value for r in errored} | ({SCORER_RAISED} if raised else set())
            )
            first = errored[0].error if errored else raised[0].scorer_error
            where = f"; tracebacks in {self.errors_log}" if errored else ""
            raise RunCannotLearn(
                f"every rollout errored ({', '.join(kinds)}) in {n} steps in a row (RL steps "
                f"{step - n + 1}-{step}): the run trains on nothing, so it stops "
                f"(rollout.max_error_steps={n}); first error: {first}{where}"
            )

    def report_nothing_to_train(
        self, step: int, groups: list[RolloutGroup], stale: list[RolloutGroup] = ()
    ) -> None:
        """A step without a single loss token: said at the first such step for each reason
        (`trainer/*` tags are simply absent at those steps). `groups`: all it sampled, `stale`
        included: the groups dropped for a token older than rollout.max_staleness allows. Not
        for a step whose rollouts all errored: its error line says why.

            step 4: nothing to train on (all 2 groups were too stale: rollout/dropped_stale
                    = 8 rollouts with a token more than rollout.max_staleness=1 versions old;
                    their prompts are generated again)
        """
        if every_rollout_errored(groups):
            return
        if stale:
            reason = (
                f"all {len(stale)} groups were too stale: "
                f"rollout/dropped_stale = {sum(len(g.rollouts) for g in stale)} rollouts with "
                f"a token more than rollout.max_staleness={self.max_staleness} versions old; "
                "their prompts are generated again"
            )
        else:
            reason = "no group had reward spread"
        key = "stale" if stale else "spread"
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(
                "step %d: nothing to train on (%s); later steps like it are not announced",
                step, reason,
            )  # fmt: skip

    def report_dropped(self, step: int, dropped: float, kept: float, seq_len: int) -> None:
        """Episodes the batcher dropped for not fitting a row (once per run)."""
        total = dropped + kept
        if total and dropped / total >= DEGENERATE_SHARE and "dropped" not in self._warned:
            self._warned.add("dropped")
            logger.warning(
                "step %d: %.0f%% of episodes are longer than batcher.seq_len + 1 = %d tokens "
                "and were dropped from training; raise batcher.seq_len",
                step, 100 * dropped / total, seq_len + 1,
            )  # fmt: skip

    def _log_tracebacks(self, step: int, errored: list[Rollout]) -> None:
        """One entry per distinct error of the step (its status and where it was raised):
        the first rollout's traceback and how many rollouts it hit."""
        first: dict[tuple, Rollout] = {}
        counts: Counter = Counter()
        for r in errored:
            frames = (r.error_details or "").rstrip().splitlines()[:-1]  # not the message
            key = (r.status, tuple(frames) if frames else r.error)
            first.setdefault(key, r)
            counts[key] += 1
        with self.errors_log.open("a") as f:
            for key, r in first.items():
                f.write(
                    f"step {step}: {counts[key]} rollouts {r.status.value}, first group "
                    f"{r.group_id} rollout {r.rollout_id}: {r.error}\n{r.error_details or ''}\n"
                )
