"""Where the processes come from: the trainer mesh and one mesh per generator replica, and the
actors spawned on them. The controller takes meshes from here and never asks for a host
itself. Placement (which GPU, which host) is decided in controller/placement.py: `plan` for
this host (called by `launch_local` here), `plan_hosts` for a Monarch job (controller/hosts.py).

    meshes = await launch_local(config.parallelism, replicas=2)
    trainer = spawn_trainer(meshes.trainer, config, vocab_size=..., log_dir=...)
    generators = spawn_generators(meshes.generators, names, config, ...)
    ...
    await stop_meshes(meshes)
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from torchtitan_rl.actors.generator import GeneratorActor
from torchtitan_rl.actors.trainer import TrainerActor
from torchtitan_rl.config import Config
from torchtitan_rl.config.job import ParallelismConfig
from torchtitan_rl.controller.placement import Placement, plan
from torchtitan_rl.generation.backends import Backend
from torchtitan_rl.losses.corrections import BEHAVIOUR_WEIGHT_CAP, trainer_correction

logger = logging.getLogger(__name__)


STOP_TIMEOUT_S = 10.0
"""How long a mesh may take to stop (its processes may be dead or stuck)."""


@dataclass(kw_only=True, slots=True)
class Meshes:
    """The proc meshes of one run: `trainer` (torch.distributed inside), `generators` (one
    per replica, in replica order). With several hosts (controller/hosts.py): the Monarch
    `job` that holds them (killed at the end, so nothing stays running) and `hosts`, the
    host of every rank by actor name, e.g. {"trainer": ["trainer_0", "trainer_1"],
    "generator": ["generator_0"]}."""

    trainer: object
    generators: list = field(default_factory=list)
    placement: Placement = field(default_factory=Placement)
    """The GPU of each trainer rank and generator replica (empty on CPU)."""
    job: object | None = None
    hosts: dict[str, list[str]] = field(default_factory=dict)
    generator_hosts: list = field(default_factory=list)
    """The host mesh each generator replica's process was spawned on (a restart spawns the
    replica's new process there)."""
    proc_kind: str = "procs"
    """The per-host dimension processes are spawned over: "gpus" or "procs"."""

    def all(self) -> list:
        return [self.trainer, *self.generators]

    def respawn_generator(self, index: int):
        """A new process for generator replica `index`, on the host its old one ran on;
        replaces it in `generators` and returns it."""
        mesh = self.generator_hosts[index].spawn_procs(per_host={self.proc_kind: 1})
        self.generators[index] = mesh
        return mesh


async def launch_local(
    parallelism: ParallelismConfig, replicas: int, backend: Backend = "native"
) -> Meshes:
    """This host: `trainer_procs` processes for the trainer and one process per generator
    replica, on the GPUs `placement.plan` gives them; the trainer's get a torch.distributed
    environment."""
    from monarch.actor import this_host
    from monarch.spmd import setup_torch_elastic_env_async

    placement = plan(parallelism, replicas, backend)
    logger.info("placement: %s", placement.describe())
    kind = "gpus" if placement.trainer else "procs"
    host = this_host()
    trainer = host.spawn_procs(per_host={kind: parallelism.trainer_procs})
    generators = [host.spawn_procs(per_host={kind: 1}) for _ in range(replicas)]
    await setup_torch_elastic_env_async(trainer)
    return Meshes(
        trainer=trainer, generators=generators, placement=placement,
        generator_hosts=[host] * replicas, proc_kind=kind,
    )  # fmt: skip


def spawn_trainer(
    mesh, config: Config, *, vocab_size: int, log_dir: str, gpus: tuple[int, ...] = ()
) -> TrainerActor:
    """The trainer actor on every process of `mesh`, with its own config sections; local
    rank r on GPU `gpus[r]` (the placement; empty: its local rank's GPU). Under
    `weights_stale_tokens` the trainer gets the default staleness weight as its correction."""
    cfg = config
    correction = trainer_correction(
        cfg.loss, cfg.correction, max_staleness=cfg.rollout.max_staleness
    )
    if correction is not cfg.correction:  # the objective differs from a synchronous run's
        logger.warning(
            "rollout.max_staleness=%d with loss.old_logprobs='recompute': each token is "
            "weighted by min(pi_old / mu, %g) (TIS at level %r); set [correction] to choose "
            "another weight", cfg.rollout.max_staleness, BEHAVIOUR_WEIGHT_CAP, correction.level,
        )  # fmt: skip
    return mesh.spawn(
        "trainer",
        TrainerActor,
        model=cfg.model,
        lora=cfg.lora,
        training=cfg.training,
        loss=cfg.loss,
        correction=correction,
        vocab_size=vocab_size,
        device=cfg.parallelism.device,
        seed=cfg.job.seed,
        cpu_threads=_threads(cfg),
        tp=cfg.parallelism.tp,
        log_dir=log_dir,
        gpus=tuple(gpus),
    )


def spawn_generator(
    mesh, name: str, config: Config, *, vocab_size: int, log_dir: str, hf_folder: str,
    gpu: int | None = None,
) -> GeneratorActor:  # fmt: skip
    """The generator actor of one replica on `mesh` (one process), named `name` (the name
    the Supervisor reports), computing on GPU `gpu` (None: GPU 0 when there is one)."""
    cfg = config
    return mesh.spawn(
        name,
        GeneratorActor,
        model=cfg.model,
        engine=cfg.generator,
        vocab_size=vocab_size,
        device=cfg.parallelism.device,
        cpu_threads=_threads(cfg),
        actor_name=name,
        log_dir=log_dir,
        hf_folder=hf_folder,
        gpu=gpu,
        lora=cfg.lora,
    )


def spawn_generators(
    meshes: list, names: list[str], config: Config, *, vocab_size: int, log_dir: str,
    hf_folder: str, placement: Placement | None = None,
) -> list[GeneratorActor]:  # fmt: skip
    """One generator actor per mesh, named `names[i]`, replica i on the GPU `placement`
    gives it."""
    placement = placement or Placement()
    return [
        spawn_generator(
            mesh,
            name,
            config,
            vocab_size=vocab_size,
            log_dir=log_dir,
            hf_folder=hf_folder,
            gpu=placement.generators[i] if placement.gpus else None,
        )  # fmt: skip
        for i, (name, mesh) in enumerate(zip(names, meshes, strict=True))
    ]


def _threads(config: Config) -> int:
    """torch threads per trainer and generator process on CPU (`ParallelismConfig.threads`):
    the cores split over every process of the run."""
    return config.parallelism.threads(
        config.parallelism.trainer_procs + config.generator.num_replicas
    )


async def stop_meshes(meshes: list) -> None:
    """Stop every mesh, each within STOP_TIMEOUT_S; a failure to stop is logged, not raised."""

    async def stop(mesh):
        try:
            await asyncio.wait_for(mesh.stop(), timeout=STOP_TIMEOUT_S)
        except Exception as e:
            logger.warning("stopping a proc mesh: %s", e)

    await asyncio.gather(*(stop(mesh) for mesh in meshes))
