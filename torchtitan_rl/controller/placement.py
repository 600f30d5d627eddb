"""Which GPU each process of a run takes: a pure function of the GPU count and the config,
decided before any process starts.

    place(gpus=4, trainer_procs=1, replicas=3, mode="auto")
    # Placement(trainer=(0,), generators=(1, 2, 3))     one GPU per role process
    place(gpus=1, trainer_procs=1, replicas=1, mode="auto")
    # Placement(trainer=(0,), generators=(0,))           the generator shares GPU 0

The trainer takes the first `trainer_procs` GPUs (rank r on GPU r). `parallelism.placement`
says where the generator replicas go:
- "split": replica i on GPU trainer_procs + i; needs trainer_procs + replicas GPUs.
- "shared": replica i on the trainer's GPU i % trainer_procs (one GPU does both jobs).
- "auto": replica i on GPU trainer_procs + i % (GPUs left after the trainer's): a GPU of
  its own while they last, then the generator GPUs take turns; "shared" when none is left.
The indices are the host's CUDA device indices as the controller sees them; every process
inherits that view (Monarch does not narrow CUDA_VISIBLE_DEVICES) and takes its GPU by
index, so a generator can still open trainer rank 0's buffer over CUDA IPC from another
GPU. A backend pinned to GPU 0 (vllm) shares it (see `plan`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan_rl.config.job import ParallelismConfig, PlacementMode
from torchtitan_rl.generation.backends import Backend, traits


@dataclass(frozen=True, slots=True)
class Placement:
    """GPU index per trainer rank and per generator replica; empty on CPU."""

    trainer: tuple[int, ...] = ()
    generators: tuple[int, ...] = ()
    gpus: int = 0
    """GPUs on the host (the job's visible ones)."""

    @property
    def split(self) -> bool:
        """True when no generator shares a GPU with a trainer rank."""
        return not set(self.trainer) & set(self.generators)

    def describe(self) -> str:
        """One line for the log: 'trainer GPUs 0,1; generator GPUs 2,3 (split)'."""
        if not self.trainer:
            return "CPU processes (no GPU placement)"
        how = "split" if self.split else "shared"

        def ids(xs):
            return ",".join(map(str, xs))

        return f"trainer GPUs {ids(self.trainer)}; generator GPUs {ids(self.generators)} ({how})"


def place(*, gpus: int, trainer_procs: int, replicas: int, mode: PlacementMode) -> Placement:
    """The placement on a host with `gpus` GPUs (0: CPU run, empty placement). Raises
    ValueError with one line naming the field and what would fit."""
    if gpus == 0:
        return Placement()
    if trainer_procs > gpus:
        raise ValueError(
            f"parallelism.trainer_procs={trainer_procs} needs one GPU per trainer process, "
            f"but {gpus} GPU(s) are visible; set parallelism.trainer_procs <= {gpus}, or "
            'parallelism.device = "cpu"'
        )
    trainer = tuple(range(trainer_procs))
    free = gpus - trainer_procs
    if mode == "split" and replicas > free:
        raise ValueError(
            f'parallelism.placement = "split" needs parallelism.trainer_procs + '
            f"generator.num_replicas = {trainer_procs} + {replicas} GPUs, but {gpus} are "
            f'visible; valid: fewer processes, or parallelism.placement = "shared" | "auto"'
        )
    if mode == "split" or (mode == "auto" and free):
        generators = tuple(trainer_procs + i % free for i in range(replicas))
    else:
        generators = tuple(i % trainer_procs for i in range(replicas))
    return Placement(trainer=trainer, generators=generators, gpus=gpus)


def plan(parallelism: ParallelismConfig, replicas: int, backend: Backend = "native") -> Placement:
    """The placement of this job on this host's GPUs (see `place`). A backend that cannot
    run on any GPU of the host (`any_gpu_of_host`, generation/backends.py: vLLM puts its
    engine on the first visible GPU whatever device it is given) runs on GPU 0, so it shares
    the trainer's GPU: "split" is refused in one line, "auto" shares."""
    own = traits(backend)
    if not own.any_gpu_of_host and parallelism.gpu_count():
        if parallelism.placement == "split":
            raise ValueError(
                'parallelism.placement = "split" is not available with generator.backend = '
                f'"{backend}" ({own.label} starts its engine on GPU 0); valid: "auto" or '
                '"shared"'
            )
        p = place(
            gpus=parallelism.gpu_count(), trainer_procs=parallelism.trainer_procs,
            replicas=replicas, mode="shared",
        )  # fmt: skip
        return dataclasses.replace(p, generators=(0,) * replicas)
    return place(
        gpus=parallelism.gpu_count(),
        trainer_procs=parallelism.trainer_procs,
        replicas=replicas,
        mode=parallelism.placement,
    )


def plan_hosts(*, replicas: int, generator_hosts: int, on_gpus: bool) -> Placement:
    """The placement over the hosts of a Monarch job: replica i goes to generator host
    i % generator_hosts (controller/hosts.py spawns it there) and takes GPU i //
    generator_hosts of it, the next free one; trainer ranks take their host's GPU LOCAL_RANK
    (the elastic environment sets it per host), so `trainer` stays empty. CPU: empty."""
    if not on_gpus:
        return Placement()
    per_host_gpu = tuple(i // generator_hosts for i in range(replicas))
    return Placement(generators=per_host_gpu, gpus=max(per_host_gpu) + 1)
