"""The step loop: generate, score, pack, train, sync, report; validation, checkpoints.

No tensor math here; every number comes from the actors or the rollout records. Processes
come from `launcher`, the warm start from `warm_start`, checkpoints and resume from `resume`,
one report per step from `report`. A run whose folder holds a complete checkpoint continues
from it. The generator replicas belong to `fleet`, which survives a dead replica (with two or
more); any other process that dies ends the run with one `ActorFailure` line (`supervision`).
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

from torchtitan_rl.actors.trainer import TrainerActor
from torchtitan_rl.config import Config, to_toml
from torchtitan_rl.config.job import check_lengths
from torchtitan_rl.controller import resume
from torchtitan_rl.controller.ahead import RolloutPipeline
from torchtitan_rl.controller.diagnostics import StepDiagnostics
from torchtitan_rl.controller.fleet import GeneratorFleet
from torchtitan_rl.controller.hosts import launch, stop_all
from torchtitan_rl.controller.launcher import Meshes, spawn_trainer
from torchtitan_rl.controller.metrics import MetricsLogger
from torchtitan_rl.controller.processes import kill_leftovers, record_processes
from torchtitan_rl.controller.progress import progress_bar, rl_postfix
from torchtitan_rl.controller.report import StepReport, StepReporter
from torchtitan_rl.controller.supervision import Supervisor
from torchtitan_rl.controller.train_stage import TrainStage
from torchtitan_rl.controller.validation import validate as run_validation
from torchtitan_rl.controller.warm_start import (
    check_demonstrations_fit,
    run_warm_start,
    warm_start_notice,
)
from torchtitan_rl.envs import build_environment
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.models.tokenizer import Tokenizer
from torchtitan_rl.rollout.advantages import compute_advantages
from torchtitan_rl.rollout.ledger import PromptLedger
from torchtitan_rl.rollout.rollouter import CollectedBatch, Rollouter
from torchtitan_rl.rollout.staleness import split_stale

logger = logging.getLogger(__name__)


class Controller:
    def __init__(self, config: Config, *, use_tqdm: bool = True):
        check_lengths(
            model_max_seq_len=config.model.max_seq_len, batcher_seq_len=config.batcher.seq_len,
            tp=config.parallelism.tp,
        )  # fmt: skip
        self.config = config
        self.run_dir = Path(config.job.output_dir) / config.job.run_name
        self.tokenizer = Tokenizer.from_file(config.model.hf_checkpoint or None)
        self.renderer = Renderer(self.tokenizer)
        self.environment = build_environment(config.env, config.job.seed, config.env_args())
        if config.warm_start.steps:
            check_demonstrations_fit(config, self.environment, self.renderer)
        self.rollouter = Rollouter(
            self.environment, self.renderer, config.env, config.rollout, config.job.seed
        )
        self.use_tqdm = use_tqdm
        self.ledger = PromptLedger()
        """Training prompts handed out, in flight, and to hand out again (rollout/ledger.py)."""
        self.lag = config.rollout.max_staleness // config.training.minibatches
        """How many steps batches are generated ahead of the step that trains on them."""
        self.pipeline = RolloutPipeline(
            self._collect, sequential=config.rollout.ahead == "pipelined"
        )
        self.trainer_version = 0
        """The trainer's policy version: the one the next RL step updates."""
        self.last_validation = float("nan")
        self.folder = resume.RunFolder(self.run_dir, config)
        """The run folder's lock and checkpoints (`completed_step`, `check_resume`)."""
        self.log_dir = self.run_dir / "logs"
        """Where a process killed by a signal leaves its Python stacks (actors/fault_log.py)."""
        self.supervisor = Supervisor(("trainer",), self.log_dir)
        self.fleet = GeneratorFleet(  # adds its actors' names to the Supervisor's
            config, self.supervisor, vocab_size=self.tokenizer.vocab_size, log_dir=self.log_dir
        )
        """The generator replicas: processes, routing, weight delivery, failover."""
        self.stage = TrainStage(config, pad_id=self.tokenizer.pad_id)
        rollout = config.rollout
        self.diagnostics = StepDiagnostics(
            self.run_dir, config.env, rollout.max_tokens, rollout.max_error_steps,
            max_staleness=rollout.max_staleness,
        )  # fmt: skip
        self.start_step = 0
        """The RL step the run continues after (0 for a fresh run, N after step_N)."""
        # What `start` builds: None (or empty) until then, so `close` works at any point.
        self.metrics: MetricsLogger | None = None
        self.reporter: StepReporter | None = None
        self.meshes: Meshes | None = None
        self.local_processes: list[tuple[dict, int]] = []  # (record, start time) on this host
        self.trainer: TrainerActor | None = None
        """The trainer mesh's actors (endpoints are called on every rank)."""

    async def start(self) -> None:
        """Spawn the meshes, restore the latest complete checkpoint if there is one, and give
        the generator the trainer's weights. Says whether it starts fresh or resumes."""
        cfg = self.config
        latest, state = self.folder.open()  # its lock first
        self.start_step = state.step if state else 0
        # on resume TensorBoard hides the events a killed run logged after the checkpoint
        self.metrics = MetricsLogger(
            self.run_dir, purge_step=self.start_step + 1 if state else None
        )
        self.reporter = StepReporter(
            self.run_dir, self.diagnostics, self.metrics, cfg.batcher.seq_len
        )
        self.supervisor.install()
        self.meshes = await launch(cfg, cfg.generator.num_replicas)
        self.supervisor.hosts = self.meshes.hosts
        self.trainer = spawn_trainer(
            self.meshes.trainer, cfg, vocab_size=self.tokenizer.vocab_size,
            log_dir=str(self.log_dir), gpus=self.meshes.placement.trainer,
        )  # fmt: skip
        self.supervisor.own(self.trainer)
        await self.fleet.start(self.meshes, self.trainer, self.run_dir)
        # before anything that may hang (the weight group forms next): close kills these
        # if they outlive their meshes
        self.local_processes = await record_processes(self.run_dir, self.trainer, self.fleet.actors)
        self.fleet.first_processes = self.local_processes  # a broken sync looks at them
        if state is not None:  # first: a checkpoint may hold the [lora] base the sync sends
            self.supervisor.where = f"while loading {latest}"
            self.ledger = await self.folder.restore(
                self.trainer, latest, state, pipeline=self.pipeline, history=self.metrics.history
            )
            self.last_validation = state.last_validation
        (self.run_dir / "config.toml").write_text(to_toml(cfg))  # after a successful restore
        self.supervisor.where = "while giving the generators their first weights"
        await self.sync_weights()  # opens the weight sync: a replica dying meanwhile is survived

    async def close(self) -> None:
        """Stop the actors and meshes (bounded waits: an actor may be dead or stuck)."""
        await self.pipeline.close()
        self.rollouter.close()  # env.workers processes
        await self.fleet.close()
        await stop_all(self.meshes)  # with several hosts, the job's hosts too
        await kill_leftovers(self.local_processes + self.fleet.local_processes)
        await self.supervisor.settle()  # the reports of deaths it survived come to it
        self.supervisor.uninstall()  # after the stops: a dying mesh still reports to it
        if self.metrics is not None:
            self.metrics.close()
        self.folder.release()

    async def save_checkpoint(self, step: int) -> Path:
        """The trainer's shards and the controller's state (`RunFolder.save`)."""
        self.supervisor.where = f"while saving the checkpoint of RL step {step}"
        return await self.folder.save(
            self.trainer, step, pipeline=self.pipeline, ledger=self.ledger,
            last_validation=self.last_validation, history=self.metrics.history,
        )  # fmt: skip

    async def sync_weights(self) -> float:
        """Every generator gets the trainer's current weights (see weight_sync/transport.py);
        returns the seconds it took."""
        seconds = await self.fleet.sync()
        self.trainer_version = self.fleet.version if self.fleet.version is not None else 0
        return seconds

    async def warm_start(self) -> None:
        notice = warm_start_notice(self.config, self.environment)
        if notice:
            logger.warning("%s", notice)
        steps = await run_warm_start(
            self.config.warm_start, environment=self.environment, renderer=self.renderer,
            pack=self.stage.pack, trainer=self.trainer, metrics=self.metrics,
            supervisor=self.supervisor, use_tqdm=self.use_tqdm,
        )  # fmt: skip
        new_base = any((await self.trainer.end_warm_start.call()).values())  # [lora]
        if new_base:
            self.fleet.regroup()  # the new base goes out first
        if steps or new_base:
            await self.sync_weights()

    async def validate(self, step: int) -> float:
        self.supervisor.where = f"while validating after RL step {step}"
        self.last_validation = await run_validation(
            self.config.validation, step, rollouter=self.rollouter, renderer=self.renderer,
            environment=self.environment, fleet=self.fleet, diagnostics=self.diagnostics,
            metrics=self.metrics, timeout_s=self.config.rollout.batch_timeout_s,
        )  # fmt: skip
        return self.last_validation

    async def _collect(self, step: int) -> CollectedBatch:
        """The batch of `step` (run by the pipeline, possibly while earlier steps train)."""
        draw = functools.partial(self.ledger.draw, step)
        play, fn = self.fleet.play_group, self.fleet.generate_fn
        return await self.rollouter.collect_batch(step, 0, fn, draw=draw, play_group=play)

    async def rl_step(self, step: int) -> dict[str, float]:
        """generate -> score -> pack + train -> sync -> report; returns the step's scalars.
        With rollout.max_staleness >= 1 the batch was generated while earlier steps trained."""
        cfg = self.config.rollout
        self.supervisor.where = f"during RL step {step}"
        t0 = time.perf_counter()
        self.pipeline.fill(step)  # no-op when it runs ahead
        batch = await self.pipeline.take(step, cfg.batch_timeout_s, self.fleet.activity)
        t_gen = time.perf_counter()
        version = self.trainer_version
        batch.groups, batch.stale = split_stale(
            batch.groups, version=version, max_staleness=cfg.max_staleness
        )
        self.ledger.settle(step)
        self.ledger.requeue([g.sample_index for g in batch.stale])
        for group in batch.groups:
            compute_advantages(group, self.config.advantage)
        train_metrics = await self.stage.train(self.trainer, batch.groups)
        if "trainer/policy_version" not in train_metrics:  # no optimizer step
            sampled = [*batch.groups, *batch.stale, *batch.filtered, *batch.surplus]
            self.diagnostics.report_nothing_to_train(step, sampled, batch.stale)
        self.trainer_version = int(train_metrics.get("trainer/policy_version", version))
        t_train = time.perf_counter()
        if self.lag and cfg.ahead == "pipelined":
            # new weights only between two batches
            await self.pipeline.wait_done(step + self.lag, cfg.batch_timeout_s, self.fleet.activity)
        sync_seconds = await self.sync_weights()
        report = StepReport(
            step=step, batch=batch, train=train_metrics, version=version,
            generate_seconds=self.pipeline.seconds.pop(step, t_gen - t0),
            trainer_wait_seconds=t_gen - t0, train_seconds=t_train - t_gen,
            sync_seconds=sync_seconds, generator_wait_seconds=self.pipeline.idle_seconds(),
            step_seconds=time.perf_counter() - t0, generators=await self.fleet.step_metrics(),
        )  # fmt: skip
        return self.reporter.report(report)

    async def run(self) -> dict[str, float]:
        """Start (or resume), warm start, then RL steps until training.steps (or
        training.stop_after); checkpoints every checkpoint.interval steps and at the end.
        A dead trainer or generator process raises ActorFailure within seconds."""
        t_start = time.perf_counter()
        await self.supervisor.watch(self._run())
        return {"wall_seconds": time.perf_counter() - t_start}

    async def _run(self) -> None:
        cfg = self.config
        await self.start()
        if self.start_step == 0:
            await self.warm_start()
            if cfg.validation.interval:
                await self.validate(0)
        last = cfg.training.last_step
        with progress_bar(cfg.training.steps, self.use_tqdm, "rl") as bar:
            bar.update(self.start_step)
            self.pipeline.fill(min(self.start_step + 1 + self.lag, cfg.training.steps))
            for step in range(self.start_step + 1, last + 1):
                m = await self.rl_step(step)
                await self._after_step(step, last)
                # the next batches start with the weights after this step (pipelined: only
                # now, after validation and checkpoint, so those see nothing in flight)
                if step < last:
                    self.pipeline.fill(min(step + 1 + self.lag, cfg.training.steps))
                bar.update(1)
                bar.set_postfix(rl_postfix(m, self.last_validation))
        self.supervisor.where = "while exporting the Hugging Face folder"
        await resume.export_hf(self.trainer, self.config, self.run_dir / "hf")
        # again at the end: the summary shows each process's peak memory over the run
        await record_processes(self.run_dir, self.trainer, self.fleet.live_actors)

    async def _after_step(self, step: int, last: int) -> None:
        """Validation and checkpoint on their intervals, and both after the final step."""
        cfg = self.config
        every = cfg.validation.interval
        if every and (step % every == 0 or step == cfg.training.steps):
            await self.validate(step)
        every = cfg.checkpoint.interval
        if every and (step % every == 0 or step == last):
            await self.save_checkpoint(step)
