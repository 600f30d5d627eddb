"""One report per RL step: built once from what the step produced, then written everywhere a
person reads it (console warnings, errors.log, rollout records, TensorBoard).

    report = StepReport(step=3, batch=batch, train=train_metrics, generate_seconds=..., ...)
    metrics = reporter.report(report)   # every scalar of the step, as logged
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torchtitan_rl.controller.diagnostics import StepDiagnostics
from torchtitan_rl.controller.metrics import MetricsLogger, batch_metrics, rollout_metrics
from torchtitan_rl.rollout.records import write_step_records
from torchtitan_rl.rollout.rollouter import CollectedBatch
from torchtitan_rl.rollout.staleness import staleness_metrics


@dataclass(kw_only=True, slots=True)
class StepReport:
    """What one RL step produced: its rollouts, its training metrics and its timings."""

    step: int
    batch: CollectedBatch
    """Every group the step sampled: trained (`groups`), filtered out, or surplus."""
    train: dict[str, float]
    """Batcher and trainer metrics (batcher/*, loss/*, trainer/*, ...)."""
    version: int
    """The policy version the step updated (staleness is counted from it)."""
    generate_seconds: float
    """Wall time the batch took to generate (it may overlap earlier steps)."""
    trainer_wait_seconds: float
    """How long the step waited for its batch (the trainer idle)."""
    train_seconds: float
    sync_seconds: float
    generator_wait_seconds: float
    """Since the last step: seconds no batch was generating (waiting for weights or room)."""
    step_seconds: float
    """Wall time of the whole step, waiting for the batch to the end of the weight sync."""
    generators: dict[str, float]
    """The fleet's scalars: generator/replicas_alive, generator/requests_rerouted."""

    def generated_tokens(self) -> int:
        """Tokens the generators sampled for the step: every group sampled, trained or not
        (filtered, surplus and stale groups cost generation time too)."""
        return sum(
            t.completion.num_tokens
            for g in self.batch.sampled()
            for r in g.rollouts
            for t in r.turns
        )

    def metrics(self) -> dict[str, float]:
        """Every scalar of the step: rollouts sampled, rollouts trained, training, speed."""
        tokens = self.train.get("batcher/num_tokens", 0.0)
        return {
            **batch_metrics(self.batch),
            **rollout_metrics(self.batch.groups),
            **staleness_metrics(self.batch.groups, version=self.version),
            "rollout/dropped_stale": float(sum(len(g.rollouts) for g in self.batch.stale)),
            **self.train,
            **self.generators,
            "perf/sync_seconds": self.sync_seconds,
            "perf/step_seconds": self.step_seconds,
            "perf/generate_seconds": self.generate_seconds,
            "perf/train_seconds": self.train_seconds,
            "perf/trainer_wait_seconds": self.trainer_wait_seconds,
            "perf/generator_wait_seconds": self.generator_wait_seconds,
            "perf/tokens_per_second": tokens / self.step_seconds,
            "perf/generated_tokens_per_second": self.generated_tokens()
            / max(self.generate_seconds, 1e-9),
        }


class StepReporter:
    """Writes a StepReport to the console (through `diagnostics`), the run's rollout records
    and TensorBoard (`metrics`)."""

    def __init__(
        self, run_dir: Path, diagnostics: StepDiagnostics, metrics: MetricsLogger, seq_len: int
    ):
        self.records_dir = run_dir / "rollouts"
        self.diagnostics = diagnostics
        self.metrics = metrics
        self.seq_len = seq_len

    def report(self, report: StepReport) -> dict[str, float]:
        """Write `report` everywhere; returns the scalars logged."""
        step, batch = report.step, report.batch
        self.diagnostics.report(
            step, [*batch.groups, *batch.stale, *batch.filtered, *batch.surplus]
        )
        write_step_records(self.records_dir, step, batch.groups, filtered=batch.filtered)
        metrics = report.metrics()
        self.diagnostics.report_dropped(
            step,
            metrics.get("batcher/num_dropped_oversized", 0.0),
            metrics.get("batcher/num_sequences", 0.0),
            self.seq_len,
        )
        self.metrics.log(metrics, step)
        return metrics
