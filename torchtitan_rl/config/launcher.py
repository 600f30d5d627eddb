"""The [launcher] section: where the hosts of the trainer and generator meshes come from.

    [launcher]
    kind = "slurm"          # "local" | "process" | "slurm" | "kubernetes"
    trainer_hosts = 2       # the trainer mesh spans 2 hosts ...
    generator_hosts = 1     # ... the generator replicas share 1 host
    slurm_partition = "gpu"
    slurm_time_limit = "04:00:00"

Processes per host come from [parallelism]: the trainer mesh puts trainer_procs /
trainer_hosts processes (one GPU each with CUDA) on each of its hosts; generator replicas
(generator.num_replicas, one process each) go round-robin over the generator hosts.
`controller/hosts.py` turns this section into a Monarch job.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Literal, get_args

LauncherKind = Literal["local", "process", "slurm", "kubernetes"]

_SLURM_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
"""sbatch --time in the forms this section accepts: HH:MM:SS or D-HH:MM:SS."""
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
"""An RFC 1123 label: what Kubernetes accepts as a namespace."""


@dataclass(kw_only=True, slots=True)
class LauncherConfig:
    """TOML section [launcher]: which hosts the trainer and generator meshes run on."""

    kind: LauncherKind = "local"
    """"local": every process on this host (no job). "process": each host a local
    subprocess (Monarch's ProcessJob: several hosts simulated on one machine). "slurm":
    hosts from an sbatch allocation (Monarch's SlurmJob). "kubernetes": pods (Monarch's
    KubernetesJob)."""
    trainer_hosts: int = 1
    """Hosts the trainer mesh spans (>= 1; parallelism.trainer_procs must divide by it).
    FSDP runs over all of them (gloo on CPU, NCCL on GPUs)."""
    generator_hosts: int = 1
    """Hosts the generator replicas are spread over, round-robin (>= 1, at most
    generator.num_replicas)."""
    host_timeout_s: int = 5
    """Seconds a host of the job may stay silent before its actors count as dead and the run
    ends (Monarch's get_actor_state_max_idle and get_proc_state_max_idle; >= 1). Monarch's
    defaults (30 s, 1 min) let a dead host go unnoticed for over a minute."""
    start_timeout_s: int = 0
    """slurm and kubernetes: seconds to wait for the hosts to come up (queueing included);
    0 waits as long as it takes."""
    slurm_partition: str = ""
    """slurm: the partition to submit to ("" = the cluster's default)."""
    slurm_time_limit: str = ""
    """slurm: the allocation's time limit, "HH:MM:SS" or "D-HH:MM:SS" ("" = the
    partition's default)."""
    slurm_account: str = ""
    """slurm: the account charged ("" = your default)."""
    slurm_python_exe: str = "python"
    """slurm: the Python that runs the Monarch workers on the allocated nodes (its
    environment must have torchtitan_rl installed)."""
    kubernetes_namespace: str = ""
    """kubernetes: the namespace of the pods (required with kind = "kubernetes")."""
    kubernetes_image: str = ""
    """kubernetes: container image for the pods Monarch's operator provisions (with
    torchtitan_rl installed); "" attaches to pods already running, found by the labels
    app.kubernetes.io/name=monarch-worker and monarch.pytorch.org/mesh-name=trainer or
    =generator."""

    @property
    def multi_host(self) -> bool:
        """True when the meshes come from a Monarch job rather than this host."""
        return self.kind != "local"

    def validate(self) -> None:
        if self.kind not in get_args(LauncherKind):
            raise ValueError(
                f"launcher.kind must be one of {get_args(LauncherKind)}; got {self.kind!r}"
            )
        for key in ("trainer_hosts", "generator_hosts"):
            if getattr(self, key) < 1:
                raise ValueError(f"launcher.{key} must be >= 1, got {getattr(self, key)}")
        if self.kind == "local" and (self.trainer_hosts, self.generator_hosts) != (1, 1):
            raise ValueError(
                f'launcher.kind = "local" runs on this one host, but launcher.trainer_hosts='
                f"{self.trainer_hosts} and launcher.generator_hosts={self.generator_hosts}; "
                'use launcher.kind = "process", "slurm" or "kubernetes" for several hosts'
            )
        if self.host_timeout_s < 1:
            raise ValueError(f"launcher.host_timeout_s must be >= 1, got {self.host_timeout_s}")
        if self.start_timeout_s < 0:
            raise ValueError(f"launcher.start_timeout_s must be >= 0, got {self.start_timeout_s}")
        if self.slurm_time_limit and not _SLURM_TIME.match(self.slurm_time_limit):
            raise ValueError(
                f'launcher.slurm_time_limit must look like HH:MM:SS or D-HH:MM:SS (or be ""), '
                f"got {self.slurm_time_limit!r}"
            )
        if self.kind == "kubernetes" and not _K8S_NAME.match(self.kubernetes_namespace):
            raise ValueError(
                'launcher.kind = "kubernetes" needs launcher.kubernetes_namespace: a lowercase '
                f"name of letters, digits and '-', got {self.kubernetes_namespace!r}"
            )
        if self.kind == "kubernetes" and importlib.util.find_spec("kubernetes") is None:
            raise ValueError(
                'launcher.kind = "kubernetes" needs the kubernetes Python client, which is not '
                "installed: pip install -e '.[kubernetes]'"
            )


def check_hosts(launcher: LauncherConfig, *, trainer_procs: int, tp: int, replicas: int) -> None:
    """Rules across [launcher], [parallelism] and [generator]; ValueError names the keys."""
    hosts = launcher.trainer_hosts
    if trainer_procs % hosts:
        raise ValueError(
            f"parallelism.trainer_procs={trainer_procs} must divide evenly over "
            f"launcher.trainer_hosts={hosts} (the same number of trainer processes per host)"
        )
    if (trainer_procs // hosts) % tp:
        raise ValueError(
            f"parallelism.tp={tp} must divide the trainer processes per host "
            f"({trainer_procs}/{hosts}): a tensor-parallel group stays on one host"
        )
    if launcher.generator_hosts > replicas:
        raise ValueError(
            f"launcher.generator_hosts={launcher.generator_hosts} exceeds "
            f"generator.num_replicas={replicas}: a host would hold no generator; use "
            f"launcher.generator_hosts <= {replicas}"
        )
