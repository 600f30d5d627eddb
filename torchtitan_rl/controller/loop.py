"""The step loop: spawn trainer and generator meshes, then rollout -> train -> sync, in order.

No tensor math here; every number comes from the actors or the rollout records. A run whose
folder holds a complete checkpoint continues from it (see `checkpoints`); a process
that dies ends the run with one `ActorFailure` line (see `supervision`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import tomli
from monarch.actor import this_host
from monarch.spmd import setup_torch_elastic_env_async

from torchtitan_rl.actors.generator import GeneratorActor
from torchtitan_rl.actors.trainer import TrainerActor
from torchtitan_rl.config import Config, to_toml
from torchtitan_rl.controller.checkpoints import CheckpointStore, ControllerState
from torchtitan_rl.controller.config import check_lengths
from torchtitan_rl.controller.diagnostics import StepDiagnostics
from torchtitan_rl.controller.metrics import MetricsLogger, rollout_metrics, validation_metrics
from torchtitan_rl.controller.summary import SUMMARY_TAGS
from torchtitan_rl.controller.supervision import SupervisionError, Supervisor
from torchtitan_rl.envs import build_environment
from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.models.tokenizer import Tokenizer
from torchtitan_rl.reductions import merge, results
from torchtitan_rl.rollout.advantages import compute_advantages
from torchtitan_rl.rollout.batcher import pack_batch
from torchtitan_rl.rollout.episodes import (
    demonstration_episodes,
    longest_run,
    rollout_to_episodes,
)
from torchtitan_rl.rollout.records import write_step_records
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.rollout.router import Router
from torchtitan_rl.training.trainer_config import TARGET_LOSS_WINDOW, recent_mean
from torchtitan_rl.types import Episode, GenerateFn, RolloutGroup, SamplingParams
from torchtitan_rl.weight_sync.transport import WeightSync

logger = logging.getLogger(__name__)

PURGE_ALL = -(10**9)
"""A TensorBoard purge step below any step a run logs (the warm start logs at steps <= 0)."""
RESUME_FROZEN = ("model.",)
"""Config keys a resume cannot change: the checkpoint's weights have that model's shape."""


def config_changes(saved: dict, config: Config) -> list[str]:
    """ "section.key: old -> new" for every key whose value differs from the saved TOML."""
    current = tomli.loads(to_toml(config))
    changes = []
    for section, values in current.items():
        for key, value in values.items():
            old = saved.get(section, {}).get(key)
            if isinstance(value, dict):  # [env.args]
                for sub, v in value.items():
                    if (old or {}).get(sub) != v:
                        changes.append(f"{section}.{key}.{sub}: {(old or {}).get(sub)!r} -> {v!r}")
            elif old != value:
                changes.append(f"{section}.{key}: {old!r} -> {value!r}")
    return changes


class ActorGenerateFn:
    """GenerateFn over a generator actor; None when the actor cannot be reached."""

    def __init__(self, generator):
        self.generator = generator

    async def __call__(self, prompt_ids, *, request_id, session_id=None, sampling=None):
        sampling = sampling or SamplingParams()
        try:
            return await self.generator.generate.call_one(
                prompt_ids, request_id, session_id, sampling
            )
        except SupervisionError:  # the process died: the Supervisor ends the run
            logger.debug("generate %s: generator died", request_id)
            return None
        except Exception as e:  # the call failed: the rollout becomes a generator error
            logger.warning("generate %s failed: %s", request_id, e)
            return None


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
            self._check_demonstrations_fit()
        self.rollouter = Rollouter(
            self.environment, self.renderer, config.env, config.rollout, config.job.seed
        )
        self.use_tqdm = use_tqdm
        self.next_sample = 0
        self.last_validation = float("nan")
        self.store = CheckpointStore(self.run_dir, config.checkpoint.keep_latest)
        replica_names = [f"generator{i}" for i in range(1, config.generator.num_replicas)]
        self.log_dir = self.run_dir / "logs"
        """Where a process killed by a signal leaves its Python stacks (actors/fault_log.py)."""
        self.supervisor = Supervisor(("trainer", "generator", *replica_names), self.log_dir)
        self.diagnostics = StepDiagnostics(self.run_dir, config.env, config.rollout.max_tokens)
        self.start_step = 0
        """The RL step the run continues after (0 for a fresh run, N after step_N)."""
        # What `start` builds: None (or empty) until then, so `close` works at any point.
        self.metrics: MetricsLogger | None = None
        self.meshes: list = []
        self.trainer: TrainerActor | None = None
        """The trainer mesh's actors (endpoints are called on every rank)."""
        self.generators: list[GeneratorActor] = []
        """One actor per generator replica; `generators[0]` is named "generator"."""
        self.router: Router | None = None
        """Session-affine routing over the replicas (None with one replica)."""
        self.generate_fn: GenerateFn | None = None
        self.weight_sync: WeightSync | None = None

    def _check_demonstrations_fit(self) -> None:
        """Before any process starts: a warm start whose demonstrations never fit a row
        would train on nothing (ValueError naming batcher.seq_len)."""
        cfg = self.config
        samples = [self.environment.train_sample(-1 - i) for i in range(cfg.warm_start.batch_size)]
        episodes = demonstration_episodes(self.environment, self.renderer, samples)
        lengths = [len(e) for e in episodes]
        limit = cfg.batcher.seq_len + 1
        if not any(n <= limit for n in lengths):
            raise ValueError(
                f"batcher.seq_len={cfg.batcher.seq_len} fits episodes of up to {limit} tokens, "
                f"but no warm-start demonstration does ({min(lengths)} to {max(lengths)} tokens "
                f"in the first batch); raise batcher.seq_len or set warm_start.steps = 0"
            )
        turns = [longest_run(e.loss_mask_L) for e in episodes]
        for key, limit in (
            ("rollout.max_tokens", cfg.rollout.max_tokens),
            ("validation.max_tokens", cfg.validation.max_tokens),
        ):
            over = sum(n > limit for n in turns)
            if over:
                logger.warning(
                    "%d of %d warm-start demonstrations have an assistant turn longer than "
                    "%s=%d (up to %d tokens): replies like them will be cut off; raise %s",
                    over, len(turns), key, limit, max(turns), key,
                )  # fmt: skip

    # ---- processes --------------------------------------------------------------------
    def last_step(self) -> int:
        """The RL step this run ends after (training.steps, or training.stop_after)."""
        steps = self.config.training.steps
        return (
            min(steps, self.config.training.stop_after)
            if self.config.training.stop_after
            else steps
        )

    def completed_step(self) -> int:
        """The RL step of the latest complete checkpoint (0 without one); reads only."""
        latest = self.store.latest()
        return CheckpointStore.load_state(latest).step if latest else 0

    def check_resume(self) -> list[str]:
        """Before anything is written or spawned: how this config differs from the latest
        checkpoint's (lines "key: old -> new"); ValueError for a change that cannot work."""
        latest = self.store.latest()
        if latest is None:
            return []
        changes = config_changes(tomli.loads((latest / "config.toml").read_text()), self.config)
        frozen = [c for c in changes if c.split(":")[0].startswith(RESUME_FROZEN)]
        if frozen:
            raise ValueError(
                f"cannot resume {latest} with a changed {frozen[0]}: the checkpoint holds "
                f"another model; use a new job.run_name"
            )
        return changes

    async def start(self) -> None:
        """Spawn the meshes, restore the latest complete checkpoint if there is one, and give
        the generator the trainer's weights. Says whether it starts fresh or resumes."""
        cfg = self.config
        changes = self.check_resume()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.store.clean_temp()
        latest = self.store.latest()
        state = CheckpointStore.load_state(latest) if latest else None
        self.start_step = state.step if state else 0
        # TensorBoard hides events a killed run logged at later steps (resume), or any at all
        # (fresh start over a run that never saved: its curves would appear twice)
        self.metrics = MetricsLogger(
            self.run_dir, purge_step=self.start_step + 1 if state else PURGE_ALL
        )
        if state is None:
            logger.warning("starting fresh in %s", self.run_dir)
        else:
            logger.warning("resuming %s after RL step %d (%s)", self.run_dir, state.step, latest)
            for change in changes:
                logger.warning("  changed since that checkpoint: %s", change)
        self.supervisor.install()
        gpu = cfg.parallelism.device == "cuda"
        kind = "gpus" if gpu else "procs"
        trainer_procs = this_host().spawn_procs(per_host={kind: cfg.parallelism.trainer_procs})
        replicas = cfg.generator.num_replicas
        generator_meshes = [this_host().spawn_procs(per_host={kind: 1}) for _ in range(replicas)]
        self.meshes = [trainer_procs, *generator_meshes]
        await setup_torch_elastic_env_async(trainer_procs)
        vocab = self.tokenizer.vocab_size
        self.trainer = trainer_procs.spawn(
            "trainer",
            TrainerActor,
            model=cfg.model,
            training=cfg.training,
            loss=cfg.loss,
            correction=cfg.correction,
            vocab_size=vocab,
            device=cfg.parallelism.device,
            seed=cfg.job.seed,
            cpu_threads=cfg.parallelism.threads(cfg.parallelism.trainer_procs),
            tp=cfg.parallelism.tp,
            log_dir=str(self.log_dir),
        )
        hf_folder = await self.generator_start_folder()
        self.generators = [
            mesh.spawn(
                name,
                GeneratorActor,
                model=cfg.model,
                engine=cfg.generator,
                vocab_size=vocab,
                device=cfg.parallelism.device,
                cpu_threads=cfg.parallelism.threads(replicas),
                actor_name=name,
                log_dir=str(self.log_dir),
                hf_folder=hf_folder,
            )
            for name, mesh in zip(self.supervisor.names[1:], generator_meshes)
        ]
        fns = [ActorGenerateFn(g) for g in self.generators]
        self.router = Router(fns) if replicas > 1 else None
        self.generate_fn = self.router or fns[0]
        self.weight_sync = await WeightSync.create(
            self.trainer, self.generators, cfg.generator.dtype
        )
        logger.info("weight sync: %s", self.weight_sync.transport)
        if state is not None:
            await self.restore(latest, state)
        (self.run_dir / "config.toml").write_text(to_toml(cfg))  # after a successful restore
        await self.sync_weights()

    async def generator_start_folder(self) -> str:
        """The Hugging Face folder the vllm backend starts from: model.hf_checkpoint, or
        the trainer's initial policy exported in the generator's dtype ("" for native)."""
        cfg = self.config
        if cfg.generator.backend != "vllm" or cfg.model.hf_checkpoint:
            return cfg.model.hf_checkpoint
        folder = self.run_dir / "generator_start_hf"
        self.supervisor.where = "while exporting the generator's starting weights"
        await self.trainer.export_hf.call(str(folder), "", cfg.generator.dtype)
        return str(folder)

    # ---- checkpoints ------------------------------------------------------------------
    async def restore(self, folder: Path, state: ControllerState) -> None:
        self.supervisor.where = f"while loading {folder}"
        await self.trainer.load_checkpoint.call(str(folder / "trainer"))
        self.next_sample = state.next_sample
        self.last_validation = state.last_validation
        state.restore_rngs()
        for tag, series in state.history.items():
            self.metrics.history[tag] = [(int(s), float(v)) for s, v in series]

    async def save_checkpoint(self, step: int) -> Path:
        """Trainer ranks write their shards, the controller its JSON; then one rename."""
        self.supervisor.where = f"while saving the checkpoint of RL step {step}"
        tmp = self.store.begin(step)
        await self.trainer.save_checkpoint.call(str(tmp / "trainer"))
        if self.config.checkpoint.export_hf:
            await self.export_hf(tmp / "hf")
        state = ControllerState.capture(
            step=step,
            next_sample=self.next_sample,
            last_validation=self.last_validation,
            history={t: self.metrics.history.get(t, []) for t in SUMMARY_TAGS},
        )
        return self.store.commit(tmp, step, state, to_toml(self.config))

    async def export_hf(self, folder: Path) -> None:
        cfg = self.config
        await self.trainer.export_hf.call(
            str(folder), cfg.model.hf_checkpoint, cfg.checkpoint.export_dtype
        )

    async def sync_weights(self) -> float:
        """Every generator gets the trainer's current weights (see weight_sync/transport.py);
        returns the seconds it took."""
        return await self.weight_sync()

    async def close(self) -> None:
        """Stop the actors and meshes (bounded waits: an actor may be dead or stuck)."""
        for generator in self.generators:
            try:
                await asyncio.wait_for(generator.close.call_one(), timeout=10)
            except Exception as e:
                logger.info("generator close: %s", e)

        async def stop(mesh):
            try:
                await asyncio.wait_for(mesh.stop(), timeout=10)
            except Exception as e:
                logger.warning("stopping a proc mesh: %s", e)

        await asyncio.gather(*(stop(mesh) for mesh in self.meshes))
        self.supervisor.uninstall()  # after the stops: a dying mesh still reports to it
        if self.metrics is not None:
            self.metrics.close()

    # ---- stages -----------------------------------------------------------------------
    def _pack(self, episodes: list[Episode]):
        return pack_batch(
            episodes,
            config=self.config.batcher,
            num_ranks=self.config.parallelism.dp,  # the ranks of one TP group share a slice
            pad_id=self.tokenizer.pad_id,
        )

    async def warm_start(self) -> None:
        ws = self.config.warm_start
        losses: list[float] = []
        with _progress(ws.steps, self.use_tqdm and ws.steps > 0, "warm start") as bar:
            for step in range(1, ws.steps + 1):
                self.supervisor.where = f"during warm-start step {step}"
                first = (step - 1) * ws.batch_size
                samples = [
                    self.environment.train_sample(-1 - first - i) for i in range(ws.batch_size)
                ]
                episodes = demonstration_episodes(self.environment, self.renderer, samples)
                batches, _ = self._pack(episodes)
                out = await self.trainer.sft_step.call(batches, ws)
                metrics = next(iter(out.values()))
                losses.append(metrics["warm_start/loss"])
                done = step == ws.steps or ws.reached_target(losses)
                if done:
                    metrics = {**metrics, "warm_start/steps": step}
                if step % 10 == 0 or done:
                    self.metrics.log(metrics, step - ws.steps)  # warm start logs at steps <= 0
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['warm_start/loss']:.3f}")
                if done:
                    bar.total = step  # an early stop ends the bar full
                    bar.refresh()
                    break
        if ws.target_loss > 0 and losses:
            _report_target_loss(ws, losses)
        await self.trainer.end_warm_start.call()
        if ws.steps:
            await self.sync_weights()

    async def validate(self, step: int) -> float:
        cfg = self.config
        self.supervisor.where = f"while validating after RL step {step}"
        samples = self.environment.validation_samples(cfg.validation.num_samples)
        greedy = SamplingParams(
            temperature=0.0,
            max_tokens=cfg.validation.max_tokens,
            stop_token_ids=tuple(self.renderer.stop_token_ids),
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

    async def rl_step(self, step: int) -> dict[str, float]:
        self.supervisor.where = f"during RL step {step}"
        t0 = time.perf_counter()
        batch = await self.rollouter.collect_batch(step, self.next_sample, self.generate_fn)
        groups, self.next_sample, rollout_stats = batch.groups, batch.next_index, batch.metrics
        t_gen = time.perf_counter()
        self.diagnostics.report(step, [*groups, *batch.filtered, *batch.surplus])
        if self.router is not None:
            self.router.reset_sessions()  # sessions never span steps
        for group in groups:
            compute_advantages(group, normalize_std=self.config.advantage.normalize_std)
        write_step_records(self.run_dir / "rollouts", step, groups, filtered=batch.filtered)
        metrics = {**rollout_stats, **rollout_metrics(groups)}
        metrics.update(await self._train(groups, step))
        self.diagnostics.report_dropped(
            step,
            metrics.get("batcher/num_dropped_oversized", 0.0),
            metrics.get("batcher/num_sequences", 0.0),
            self.config.batcher.seq_len,
        )
        t_train = time.perf_counter()
        metrics["perf/sync_seconds"] = await self.sync_weights()
        seconds = time.perf_counter() - t0
        tokens = metrics.get("batcher/num_tokens", 0.0)
        generated = sum(
            t.completion.num_tokens for g in groups for r in g.rollouts for t in r.turns
        )
        metrics.update(
            {
                "perf/step_seconds": seconds,
                "perf/generate_seconds": t_gen - t0,
                "perf/train_seconds": t_train - t_gen,
                "perf/tokens_per_second": tokens / seconds,
                "perf/generated_tokens_per_second": generated / max(t_gen - t0, 1e-9),
            }
        )
        self.metrics.log(metrics, step)
        return metrics

    async def _train(self, groups: list[RolloutGroup], step: int) -> dict[str, float]:
        """One RL step on the trainer: an optimizer step per minibatch of whole groups
        (`training.minibatches`), in one call (pi_old is recomputed before the first)."""
        n = self.config.training.minibatches
        updates, packed = [], []
        for chunk in (groups[i::n] for i in range(n)):
            batches, batch_metrics = self._pack(self._episodes(chunk))
            packed.append(batch_metrics)
            if any(mb.num_global_loss_tokens for mb in batches[0]):
                updates.append(batches)
        metrics = results(merge(packed))
        if not updates:
            logger.warning("step %d: nothing to train on (no group had reward spread)", step)
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
        with _progress(cfg.training.steps, self.use_tqdm, "rl") as bar:
            bar.update(self.start_step)
            for step in range(self.start_step + 1, last + 1):
                m = await self.rl_step(step)
                await self._after_step(step, last)
                bar.update(1)
                bar.set_postfix(
                    reward=f"{m.get('rollout_reward/mean', float('nan')):.3f}",
                    val=f"{self.last_validation:.3f}",
                    loss=f"{m.get('loss/mean', float('nan')):.4f}",
                    tok_s=f"{m['perf/tokens_per_second']:.0f}",
                )
        self.supervisor.where = "while exporting the Hugging Face folder"
        await self.export_hf(self.run_dir / "hf")

    async def _after_step(self, step: int, last: int) -> None:
        """Validation and checkpoint on their intervals, and both after the final step."""
        cfg = self.config
        every = cfg.validation.interval
        if every and (step % every == 0 or step == cfg.training.steps):
            await self.validate(step)
        every = cfg.checkpoint.interval
        if every and (step % every == 0 or step == last):
            await self.save_checkpoint(step)


MIN_BAR_COLUMNS = 40
"""Below this a terminal's reported width is not believed (some report 0): use 80."""


def _report_target_loss(ws, losses: list[float]) -> None:
    mean, window = recent_mean(losses), min(len(losses), TARGET_LOSS_WINDOW)
    if ws.reached_target(losses):
        logger.warning(
            "warm start stopped after %d of at most %d steps: mean loss %.3f of the last %d "
            "reached warm_start.target_loss=%g", len(losses), ws.steps, mean, window,
            ws.target_loss,
        )  # fmt: skip
    else:
        logger.warning(
            "warm start ran all %d steps: mean loss %.3f of the last %d stayed above "
            "warm_start.target_loss=%g; RL starts from here (raise warm_start.steps to go on)",
            ws.steps, mean, window, ws.target_loss,
        )  # fmt: skip


def _progress(total: int, enabled: bool, desc: str):
    import shutil

    from tqdm import tqdm

    columns = shutil.get_terminal_size(fallback=(80, 24)).columns
    fixed = None if columns >= MIN_BAR_COLUMNS else 80
    return tqdm(
        total=total, desc=desc, unit="step", disable=not enabled,
        dynamic_ncols=fixed is None, ncols=fixed,
    )  # fmt: skip
