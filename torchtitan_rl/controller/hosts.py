"""Meshes on several hosts through a Monarch job ([launcher] kind = "process", "slurm" or
"kubernetes"); `launch` picks this or `launcher.launch_local`.

    job = build_job(config.launcher, config.parallelism, replicas=2)
    # ProcessJob({"trainer": 2, "generator": 1}): hosts trainer_0, trainer_1, generator_0
    meshes = await launch_job(config, replicas=2, job=job)
    # meshes.trainer: trainer_procs / trainer_hosts processes on each trainer host, one
    #   torch.distributed world over all of them (FSDP across hosts)
    # meshes.generators[i]: one process on generator host i % generator_hosts
    ...
    await stop_all(meshes)  # the meshes, then the job: no host is left running

The job's host meshes are named "trainer" and "generator"; host j of a mesh is called
"<mesh>_<j>" in failure lines (ProcessJob names its host processes the same way).
"""

from __future__ import annotations

import logging

from torchtitan_rl.config import Config
from torchtitan_rl.config.job import ParallelismConfig
from torchtitan_rl.config.launcher import LauncherConfig
from torchtitan_rl.controller.launcher import Meshes, launch_local, stop_meshes
from torchtitan_rl.controller.placement import plan_hosts

logger = logging.getLogger(__name__)

TRAINER, GENERATOR = "trainer", "generator"
"""The job's host mesh names (Kubernetes mesh names: lowercase letters and digits only)."""


def _proc_kind(parallelism: ParallelismConfig) -> str:
    return "gpus" if parallelism.device == "cuda" else "procs"


def gpus_per_host(launcher: LauncherConfig, parallelism: ParallelismConfig, replicas: int):
    """GPUs each host of the job must have (None on CPU): its trainer processes, or the
    generator replicas the busiest generator host holds, whichever is more."""
    if parallelism.device == "cpu":
        return None
    trainer = parallelism.trainer_procs // launcher.trainer_hosts
    generator = -(-replicas // launcher.generator_hosts)
    return max(trainer, generator)


def build_job(launcher: LauncherConfig, parallelism: ParallelismConfig, replicas: int):
    """The Monarch job `launcher.kind` names, not yet applied (nothing is started or
    submitted until `job.state()`)."""
    meshes = {TRAINER: launcher.trainer_hosts, GENERATOR: launcher.generator_hosts}
    gpus = gpus_per_host(launcher, parallelism, replicas)
    timeout = launcher.start_timeout_s or None
    if launcher.kind == "process":
        from monarch._src.job.process import ProcessJob

        return ProcessJob(meshes)
    if launcher.kind == "slurm":
        from monarch._src.job.slurm import SlurmJob

        return SlurmJob(
            meshes,
            python_exe=launcher.slurm_python_exe,
            job_name="torchtitan_rl",
            time_limit=launcher.slurm_time_limit or None,
            partition=launcher.slurm_partition or None,
            account=launcher.slurm_account or None,
            gpus_per_node=gpus,
            job_start_timeout=timeout,
        )
    if launcher.kind == "kubernetes":
        # needs the kubernetes client (checked with the config: LauncherConfig.validate)
        from monarch._src.job.kubernetes import ImageSpec, KubernetesJob

        job = KubernetesJob(namespace=launcher.kubernetes_namespace, timeout=timeout)
        for name, pods in kubernetes_meshes(launcher, gpus).items():
            spec = ImageSpec(pods["image"], resources=pods["resources"]) if pods["image"] else None
            job.add_mesh(name, pods["num_replicas"], image_spec=spec)
        return job
    raise AssertionError(f"no job for launcher.kind={launcher.kind!r}")


def kubernetes_meshes(launcher: LauncherConfig, gpus: int | None) -> dict[str, dict]:
    """What `KubernetesJob.add_mesh` gets per mesh: pods, and the image Monarch's operator
    provisions them from ("" = attach to pods already running) with their GPU request, e.g.
    {"trainer": {"num_replicas": 2, "image": "ghcr.io/me/rl:1", "resources":
    {"nvidia.com/gpu": 4}}, "generator": {...}}."""
    resources = {"nvidia.com/gpu": gpus} if gpus and launcher.kubernetes_image else None
    hosts = {TRAINER: launcher.trainer_hosts, GENERATOR: launcher.generator_hosts}
    return {
        name: {"num_replicas": n, "image": launcher.kubernetes_image, "resources": resources}
        for name, n in hosts.items()
    }


HOST_SILENCE = "{}s"
"""Monarch's status queries (get_actor_state_max_idle, get_proc_state_max_idle): how long a
host may stay silent before its actors count as dead: set from launcher.host_timeout_s, as
Monarch's defaults (30 s, 1 min) report a dead host a minute late (docs/hosts.md)."""


def watch_hosts(launcher: LauncherConfig) -> None:
    """A host that stops answering for launcher.host_timeout_s fails its actors (this
    process's Monarch settings: the mesh controllers run here)."""
    from monarch._rust_bindings.monarch_hyperactor.config import configure

    silence = HOST_SILENCE.format(launcher.host_timeout_s)
    configure(get_actor_state_max_idle=silence, get_proc_state_max_idle=silence)


async def launch_job(config: Config, replicas: int, job=None) -> Meshes:
    """The trainer mesh over the job's trainer hosts, one generator mesh per replica spread
    round-robin over its generator hosts. `job`: from `build_job` unless given."""
    from monarch.spmd import setup_torch_elastic_env_async

    launcher, parallelism = config.launcher, config.parallelism
    job = job if job is not None else build_job(launcher, parallelism, replicas)
    watch_hosts(launcher)
    try:
        state = job.state(cached_path=None)  # submits or starts the hosts; no cache file
    except Exception as e:  # e.g. no sbatch here, a rejected allocation, no cluster access
        _kill(job)
        raise RuntimeError(
            f'launcher.kind = "{launcher.kind}": the job\'s hosts did not come up: '
            f"{type(e).__name__}: {e}"
        ) from e
    kind = _proc_kind(parallelism)
    per_host = parallelism.trainer_procs // launcher.trainer_hosts
    try:
        trainer = getattr(state, TRAINER).spawn_procs(per_host={kind: per_host})
        generator_hosts = getattr(state, GENERATOR)
        replica_hosts = [
            generator_hosts.slice(hosts=i % launcher.generator_hosts) for i in range(replicas)
        ]
        generators = [host.spawn_procs(per_host={kind: 1}) for host in replica_hosts]
        await setup_torch_elastic_env_async(trainer)  # one world over every trainer host
    except BaseException:
        _kill(job)
        raise
    hosts = {TRAINER: [f"{TRAINER}_{r // per_host}" for r in range(parallelism.trainer_procs)]}
    for i in range(replicas):
        name = GENERATOR if i == 0 else f"{GENERATOR}{i}"
        hosts[name] = [f"{GENERATOR}_{i % launcher.generator_hosts}"]
    logger.warning(
        "launcher %s: trainer on %s, generators on %s",
        launcher.kind,
        ", ".join(dict.fromkeys(hosts[TRAINER])),
        ", ".join(f"{n}@{h[0]}" for n, h in hosts.items() if n != TRAINER),
    )
    placement = plan_hosts(
        replicas=replicas, generator_hosts=launcher.generator_hosts, on_gpus=kind == "gpus"
    )
    return Meshes(
        trainer=trainer, generators=generators, job=job, hosts=hosts, placement=placement,
        generator_hosts=replica_hosts, proc_kind=kind,
    )  # fmt: skip


async def launch(config: Config, replicas: int) -> Meshes:
    """This host ([launcher] kind = "local") or the hosts of a Monarch job."""
    if not config.launcher.multi_host:
        return await launch_local(config.parallelism, replicas, config.generator.backend)
    return await launch_job(config, replicas)


async def stop_all(meshes: Meshes | None) -> None:
    """Stop every mesh, then kill the job's hosts (whatever they still run goes with them)."""
    if meshes is None:
        return
    await stop_meshes(meshes.all())
    if meshes.job is not None:
        _kill(meshes.job)


def _kill(job) -> None:
    """End the job's hosts and whatever runs on them; a failure to is logged, not raised."""
    try:
        job.kill()
    except Exception as e:  # e.g. a host already gone, or a scheduler that cannot be reached
        logger.warning("killing the job's hosts: %s", e)
