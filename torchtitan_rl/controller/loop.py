"""The step loop: generate, score, pack, train, sync, report; validation and checkpoints on
their intervals.

No tensor math here; every number comes from the actors or the rollout records. Processes
come from `launcher`, the warm start from `warm_start`, checkpoints and resume from `resume`,
one report per step from `report`. A run whose folder holds a complete checkpoint continues
from it; a process that dies ends the run with one `ActorFailure` line (see `supervision`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from pathlib import Path

from torchtitan_rl.actors.generator import GeneratorActor
from torchtitan_rl.actors.trainer import TrainerActor
from torchtitan_rl.config import Config, to_toml
from torchtitan_rl.config.job import check_lengths
from torchtitan_rl.controller import resume
from torchtitan_rl.controller.ahead import RolloutPipeline
from torchtitan_rl.controller.checkpoints import CheckpointStore, ControllerState
from torchtitan_rl.controller.diagnostics import StepDiagnostics
from torchtitan_rl.controller.hosts import launch, stop_all
from torchtitan_rl.controller.launcher import (
    ActorGenerateFn,
    Meshes,
    spawn_generators,
    spawn_trainer,
)
from torchtitan_rl.controller.metrics import MetricsLogger, validation_metrics
from torchtitan_rl.controller.processes import (
    ask_processes,
    kill_leftovers,
    on_this_machine,
    record_processes,
)
from torchtitan_rl.controller.progress import progress_bar, rl_postfix
from torchtitan_rl.controller.report import StepReport, StepReporter
from torchtitan_rl.controller.run_lock import RunLock
from torchtitan_rl.controller.summary import SUMMARY_TAGS
from torchtitan_rl.controller.supervision import Supervisor
from torchtitan_rl.controller.warm_start import (
    check_demonstrations_fit,
    run_warm_start,
    warm_start_notice,
)
from torchtitan_rl.envs import build_environment
from torchtitan_rl.generation.backends import traits
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.models.tokenizer import Tokenizer
from torchtitan_rl.reductions import merge, results
from torchtitan_rl.rollout.advantages import compute_advantages
from torchtitan_rl.rollout.batcher import pack_batch
from torchtitan_rl.rollout.episodes import (
    rollout_to_episodes,
)
from torchtitan_rl.rollout.ledger import PromptLedger
from torchtitan_rl.rollout.rollouter import CollectedBatch, Rollouter
from torchtitan_rl.rollout.router import Router
from torchtitan_rl.rollout.staleness import split_stale
from torchtitan_rl.types import Episode, GenerateFn, RolloutGroup, SamplingParams
from torchtitan_rl.weight_sync.transport import WeightSync

logger = logging.getLogger(__name__)


class Controller:
    def __init__(self, config: Config, *, use_tqdm: bool = True):
        check_lengths(
            model_max_seq_len=config.model.max_seq_len,
            batcher_seq_len=config.batcher.seq_len,
            tp=config.parallelism.tp,
        )
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
        self.store = CheckpointStore(self.run_dir, config.checkpoint.keep_latest)
        self.lock = RunLock(self.run_dir)
        replica_names = [f"generator{i}" for i in range(1, config.generator.num_replicas)]
        self.log_dir = self.run_dir / "logs"
        """Where a process killed by a signal leaves its Python stacks (actors/fault_log.py)."""
        self.supervisor = Supervisor(("trainer", "generator", *replica_names), self.log_dir)
        self.diagnostics = StepDiagnostics(
            self.run_dir,
            config.env,
            config.rollout.max_tokens,
            config.rollout.max_error_steps,
            max_staleness=config.rollout.max_staleness,
        )
        self.start_step = 0
        """The RL step the run continues after (0 for a fresh run, N after step_N)."""
        # What `start` builds: None (or empty) until then, so `close` works at any point.
        self.metrics: MetricsLogger | None = None
        self.reporter: StepReporter | None = None
        self.meshes: Meshes | None = None
        self.local_processes: list[tuple[dict, int]] = []  # (record, start time) on this host
        self.trainer: TrainerActor | None = None
        """The trainer mesh's actors (endpoints are called on every rank)."""
        self.generators: list[GeneratorActor] = []
        """One actor per generator replica; `generators[0]` is named "generator"."""
        self.router: Router | None = None
        """Session-affine routing over the replicas (None with one replica)."""
        self.generate_fn: GenerateFn | None = None
        self.weight_sync: WeightSync | None = None

    # ---- processes --------------------------------------------------------------------
    def last_step(self) -> int:
        """The RL step this run ends after (training.steps, or training.stop_after)."""
        training = self.config.training
        return min(training.steps, training.stop_after) if training.stop_after else training.steps

    def completed_step(self) -> int:
        """The RL step of the latest complete checkpoint (0 without one); reads only."""
        latest = self.store.latest()
        return CheckpointStore.load_state(latest).step if latest else 0

    def check_resume(self) -> list[str]:
        """Before anything is written or spawned: how this config differs from the latest
        checkpoint's (lines "key: old -> new"); ValueError for a change that cannot work."""
        return resume.check_resume(self.store, self.config)

    async def start(self) -> None:
        """Spawn the meshes, restore the latest complete checkpoint if there is one, and give
        the generator the trainer's weights. Says whether it starts fresh or resumes."""
        cfg = self.config
        self.lock.acquire()  # before anything in the folder is read for use or written
        changes = self.check_resume()
        for path, problem in self.store.set_aside_damaged():
            logger.warning("checkpoint damaged: %s; moved it to %s", problem, path)
        self.store.clean_temp()
        latest = self.store.latest()
        state = CheckpointStore.load_state(latest) if latest else None
        self.start_step = state.step if state else 0
        if state is None:
            cleared = resume.clear_earlier_run(self.run_dir)
            said = f" (deleted {', '.join(cleared)} of an earlier run that left no checkpoint)"
            logger.warning("starting fresh in %s%s", self.run_dir, said if cleared else "")
        # on resume TensorBoard hides the events a killed run logged after the checkpoint
        self.metrics = MetricsLogger(
            self.run_dir, purge_step=self.start_step + 1 if state else None
        )
        self.reporter = StepReporter(
            self.run_dir, self.diagnostics, self.metrics, cfg.batcher.seq_len
        )
        if state is not None:
            logger.warning("resuming %s after RL step %d (%s)", self.run_dir, state.step, latest)
            for change in changes:
                logger.warning("  changed since that checkpoint: %s", change)
        self.supervisor.install()
        replicas = cfg.generator.num_replicas
        self.meshes = await launch(cfg, replicas)
        self.supervisor.hosts = self.meshes.hosts
        vocab, log_dir = self.tokenizer.vocab_size, str(self.log_dir)
        gpus = self.meshes.placement
        self.trainer = spawn_trainer(
            self.meshes.trainer, cfg, vocab_size=vocab, log_dir=log_dir, gpus=gpus.trainer
        )
        self.generators = spawn_generators(
            self.meshes.generators, list(self.supervisor.names[1:]), cfg, vocab_size=vocab,
            log_dir=log_dir, hf_folder=await self.generator_start_folder(),
            placement=gpus,
        )  # fmt: skip
        processes = await ask_processes(self.trainer, self.generators)
        # before anything that may hang (the weight group forms next): close kills these
        # if they outlive their meshes
        self.local_processes = on_this_machine(processes)
        record_processes(self.run_dir, processes)
        fns = [
            ActorGenerateFn(g, name) for g, name in zip(self.generators, self.supervisor.names[1:])
        ]
        self.router = Router(fns) if replicas > 1 else None
        self.generate_fn = self.router or fns[0]
        self.weight_sync = await WeightSync.create(
            self.trainer, self.generators, cfg.generator.dtype, cfg.launcher.weight_transport
        )
        self.weight_sync.peer_failure_wait_s = max(30.0, cfg.launcher.host_timeout_s + 20.0)
        backend = f" ({self.weight_sync.backend})" if self.weight_sync.backend else ""
        logger.info("weight sync: %s%s", self.weight_sync.transport, backend)
        if state is not None:
            await self.restore(latest, state)
        (self.run_dir / "config.toml").write_text(to_toml(cfg))  # after a successful restore
        await self.sync_weights()

    async def generator_start_folder(self) -> str:
        """The Hugging Face folder a backend that starts from one (vllm) starts from:
        model.hf_checkpoint, or the trainer's initial policy exported in the generator's
        dtype (model.hf_checkpoint, often "", for one that does not)."""
        cfg = self.config
        if not traits(cfg.generator.backend).starts_from_hf_folder or cfg.model.hf_checkpoint:
            return cfg.model.hf_checkpoint
        folder = self.run_dir / "generator_start_hf"
        self.supervisor.where = "while exporting the generator's starting weights"
        await self.trainer.export_hf.call(str(folder), "", cfg.generator.dtype)
        return str(folder)

    async def close(self) -> None:
        """Stop the actors and meshes (bounded waits: an actor may be dead or stuck)."""
        await self.pipeline.close()
        self.rollouter.close()  # env.workers processes
        for generator in self.generators:
            try:
                await asyncio.wait_for(generator.close.call_one(), timeout=10)
            except Exception as e:
                logger.info("generator close: %s", e)
        await stop_all(self.meshes)  # with several hosts, the job's hosts too
        await kill_leftovers(self.local_processes)
        self.supervisor.uninstall()  # after the stops: a dying mesh still reports to it
        if self.metrics is not None:
            self.metrics.close()
        self.lock.release()

    # ---- checkpoints ------------------------------------------------------------------
    async def restore(self, folder: Path, state: ControllerState) -> None:
        self.supervisor.where = f"while loading {folder}"
        await resume.restore(self.trainer, folder, state)
        self.ledger = PromptLedger(next_fresh=state.next_sample, requeued=list(state.requeued))
        self.pipeline.restore(state.step, resume.load_pending(folder))
        self.last_validation = state.last_validation
        for tag, series in state.history.items():
            self.metrics.history[tag] = [(int(s), float(v)) for s, v in series]

    async def save_checkpoint(self, step: int) -> Path:
        """The trainer's shards and the controller's state; batches generated ahead are kept
        whole, and the prompts of batches still in flight are handed out again on resume."""
        self.supervisor.where = f"while saving the checkpoint of RL step {step}"
        pending = self.pipeline.finished()
        next_fresh, requeued = self.ledger.saved(keep=set(pending))
        return await resume.save(
            self.store, self.trainer, self.config, step,
            capture=lambda: ControllerState.capture(
                step=step,
                next_sample=next_fresh,
                requeued=requeued,
                last_validation=self.last_validation,
                history={t: self.metrics.history.get(t, []) for t in SUMMARY_TAGS},
            ),
            export_hf=self.export_hf, pending=pending,
        )  # fmt: skip

    async def export_hf(self, folder: Path) -> None:
        cfg = self.config
        await self.trainer.export_hf.call(
            str(folder), cfg.model.hf_checkpoint, cfg.checkpoint.export_dtype
        )

    async def sync_weights(self) -> float:
        """Every generator gets the trainer's current weights (see weight_sync/transport.py);
        returns the seconds it took."""
        seconds = await self.weight_sync()
        if self.weight_sync.version is not None:
            self.trainer_version = self.weight_sync.version
        return seconds

    # ---- stages -----------------------------------------------------------------------
    def _pack(self, episodes: list[Episode]):
        return pack_batch(
            episodes,
            config=self.config.batcher,
            num_ranks=self.config.parallelism.dp,  # the ranks of one TP group share a slice
            pad_id=self.tokenizer.pad_id,
        )

    async def warm_start(self) -> None:
        notice = warm_start_notice(self.config, self.environment)
        if notice:
            logger.warning("%s", notice)
        steps = await run_warm_start(
            self.config.warm_start, environment=self.environment, renderer=self.renderer,
            pack=self._pack, trainer=self.trainer, metrics=self.metrics,
            supervisor=self.supervisor, use_tqdm=self.use_tqdm,
        )  # fmt: skip
        await self.trainer.end_warm_start.call()
        if steps:
            await self.sync_weights()

    async def validate(self, step: int) -> float:
        cfg = self.config
        self.supervisor.where = f"while validating after RL step {step}"
        samples = self.environment.validation_samples(cfg.validation.num_samples)
        greedy = SamplingParams(
            temperature=0.0,
            max_tokens=cfg.validation.max_tokens,
            stop_token_ids=tuple(self.renderer.stop_token_ids),
            stop_sequences=self.rollouter.stop_sequences,
        )
        rollouts = await asyncio.gather(
            *(
                self.rollouter.run_single_rollout(
                    s, self.generate_fn, group_id=i, rollout_id=0, sampling=greedy, step=-1
                )
                for i, s in enumerate(samples)
            )
        )
        self.diagnostics.report(step, [RolloutGroup(group_id=0, rollouts=rollouts)], training=False)
        metrics = validation_metrics(rollouts)
        self.metrics.log(metrics, step)
        self.last_validation = metrics.get("validation_reward/mean", float("nan"))
        return self.last_validation

    async def _collect(self, step: int) -> CollectedBatch:
        """The batch of `step` (run by the pipeline, possibly while earlier steps train)."""
        draw = functools.partial(self.ledger.draw, step)
        return await self.rollouter.collect_batch(step, 0, self.generate_fn, draw=draw)

    async def rl_step(self, step: int) -> dict[str, float]:
        """generate -> score -> pack + train -> sync -> report; returns the step's scalars.
        With rollout.max_staleness >= 1 the batch was generated while earlier steps trained."""
        cfg = self.config.rollout
        self.supervisor.where = f"during RL step {step}"
        t0 = time.perf_counter()
        self.pipeline.fill(step)  # no-op when it runs ahead
        batch = await self.pipeline.take(step, cfg.batch_timeout_s, self._activity)
        t_gen = time.perf_counter()
        version = self.trainer_version
        batch.groups, batch.stale = split_stale(
            batch.groups, version=version, max_staleness=cfg.max_staleness
        )
        self.ledger.settle(step)
        self.ledger.requeue([g.sample_index for g in batch.stale])
        for group in batch.groups:
            compute_advantages(group, self.config.advantage)
        train_metrics = await self._train(batch.groups, step)
        if "trainer/policy_version" not in train_metrics:  # no optimizer step
            sampled = [*batch.groups, *batch.stale, *batch.filtered, *batch.surplus]
            self.diagnostics.report_nothing_to_train(step, sampled, batch.stale)
        self.trainer_version = int(train_metrics.get("trainer/policy_version", version))
        t_train = time.perf_counter()
        if self.lag and cfg.ahead == "pipelined":
            # new weights only between two batches
            await self.pipeline.wait_done(step + self.lag, cfg.batch_timeout_s, self._activity)
        sync_seconds = await self.sync_weights()
        report = StepReport(
            step=step, batch=batch, train=train_metrics, version=version,
            generate_seconds=self.pipeline.seconds.pop(step, t_gen - t0),
            trainer_wait_seconds=t_gen - t0, train_seconds=t_train - t_gen,
            sync_seconds=sync_seconds, generator_wait_seconds=self.pipeline.idle_seconds(),
            step_seconds=time.perf_counter() - t0,
        )  # fmt: skip
        return self.reporter.report(report)

    async def _activity(self) -> str:
        """What every generator is doing, for a step that waited too long for its batch."""
        fns = self.router.replicas if self.router is not None else [self.generate_fn]
        phrases = [fn.activity() for fn in fns]
        if not any(fn.in_flight for fn in fns):
            phrases.append(
                "so the rollouts wait on the environment (env.step_timeout_s="
                f"{self.config.env.step_timeout_s:g})"
            )
        return "; ".join(phrases)

    async def _train(self, groups: list[RolloutGroup], step: int) -> dict[str, float]:
        """One RL step on the trainer: an optimizer step per minibatch of whole groups
        (`training.minibatches`), in one call (pi_old is recomputed before the first).
        Nothing to train on: no call, and no `trainer/*` scalars."""
        n = self.config.training.minibatches
        updates, packed = [], []
        for chunk in (groups[i::n] for i in range(n)):
            batches, batch_metrics = self._pack(self._episodes(chunk))
            packed.append(batch_metrics)
            if any(mb.num_global_loss_tokens for mb in batches[0]):
                updates.append(batches)
        metrics = results(merge(packed))
        if not updates:
            return metrics
        out = await self.trainer.train_step.call(updates, self.config.rollout.temperature)
        return {**metrics, **next(iter(out.values()))}

    def _episodes(self, groups: list[RolloutGroup]) -> list[Episode]:
        episodes = []
        for group in groups:
            for rollout in group.rollouts:
                episodes.extend(rollout_to_episodes(rollout))
        return episodes

    # ---- the run ----------------------------------------------------------------------
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
        last = self.last_step()
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
        await self.export_hf(self.run_dir / "hf")
        # again at the end: the summary shows each process's peak memory over the run
        record_processes(self.run_dir, await ask_processes(self.trainer, self.generators))

    async def _after_step(self, step: int, last: int) -> None:
        """Validation and checkpoint on their intervals, and both after the final step."""
        cfg = self.config
        every = cfg.validation.interval
        if every and (step % every == 0 or step == cfg.training.steps):
            await self.validate(step)
        every = cfg.checkpoint.interval
        if every and (step % every == 0 or step == last):
            await self.save_checkpoint(step)
