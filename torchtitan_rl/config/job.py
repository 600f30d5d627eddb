"""The job-wide config sections: job, parallelism, validation, checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from torchtitan_rl.checks import check_range
from torchtitan_rl.device import DTYPE_NAMES, DtypeName

Device = Literal["auto", "cpu", "cuda"]
PlacementMode = Literal["auto", "split", "shared"]


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """TOML section [job]."""

    output_dir: str = "outputs"
    """Folder that holds one sub-folder per run."""
    run_name: str = "alphabet_sort_tiny"
    """Run folder name: logs land in <output_dir>/<run_name>/ (tb/, config.toml, ...)."""
    seed: int = 0
    """Seeds model init, prompt order and every request's sampling."""

    def validate(self) -> None:
        if not self.run_name or "/" in self.run_name:
            raise ValueError(f"job.run_name must be a non-empty folder name, got {self.run_name!r}")


@dataclass(kw_only=True, slots=True)
class ParallelismConfig:
    """TOML section [parallelism]: how many processes, and on what."""

    trainer_procs: int = 2
    """Trainer processes: one per GPU, or CPU processes. They form a (dp, tp) grid:
    trainer_procs / tp FSDP data-parallel groups of tp tensor-parallel ranks each."""
    tp: int = 1
    """Trainer tensor-parallel degree, >= 1, dividing trainer_procs (and the model's query
    and key/value head counts, and batcher.seq_len). Consecutive ranks form a TP group
    that shares one batch slice; the LM head is vocab-parallel (losses/logprobs.py)."""
    device: Device = "auto"
    """"auto" (CUDA when present, else CPU), "cpu" or "cuda"."""
    placement: PlacementMode = "auto"
    """Where generator replicas run on a GPU host (the trainer takes GPUs 0..trainer_procs-1):
    "split" (replica i on GPU trainer_procs + i; fails at start when GPUs are short),
    "shared" (replica i on the trainer's GPU i % trainer_procs), or "auto" (a GPU of its own
    while spare GPUs last, then the spare GPUs take turns; "shared" when there is none). The log and the run summary name each process's GPU.
    No effect on CPU."""
    cpu_threads_per_proc: int = 0
    """torch threads in each trainer/generator process on CPU; 0 = the cores this process may
    run on (its CPU affinity: taskset, cgroups) split over every trainer and generator process
    of the run, at least 1 (2 cores, the default 3 processes: 1 thread each). The threads of
    all processes never outnumber the cores, also while the roles take turns: a torch process
    with a thread per core slows ~10x as soon as other work takes one of those cores (its
    threads wait for each other at every op; docs/benchmarks.md, "Cores, processes")."""

    def threads(self, procs: int) -> int:
        """torch threads per process when the run has `procs` trainer and generator
        processes on CPU: the set value, or the usable cores split over them."""
        import os

        if self.cpu_threads_per_proc:
            return self.cpu_threads_per_proc
        return max(1, len(os.sched_getaffinity(0)) // procs)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many slices the batcher cuts each batch into."""
        return self.trainer_procs // self.tp

    def validate(self) -> None:
        if self.trainer_procs < 1:
            raise ValueError(f"parallelism.trainer_procs must be >= 1, got {self.trainer_procs}")
        if self.tp < 1 or self.trainer_procs % self.tp:
            raise ValueError(
                f"parallelism.tp must be >= 1 and divide trainer_procs={self.trainer_procs}, "
                f"got {self.tp}"
            )
        if self.cpu_threads_per_proc < 0:
            raise ValueError(
                f"parallelism.cpu_threads_per_proc must be >= 0, got {self.cpu_threads_per_proc}"
            )
        for key, kind in (("device", Device), ("placement", PlacementMode)):
            if getattr(self, key) not in get_args(kind):
                raise ValueError(
                    f"parallelism.{key} must be one of {get_args(kind)}; got {getattr(self, key)!r}"
                )

    def gpu_count(self) -> int:
        """GPUs this job places processes on (0 on CPU). Checked where a job starts, not when
        a config loads: tests and tools load configs on machines of any shape."""
        import torch

        gpus = torch.cuda.device_count() if self.device != "cpu" else 0
        if self.device == "cuda" and not gpus:
            raise ValueError(
                'parallelism.device = "cuda", but no CUDA device is visible; valid here: '
                '"auto" or "cpu"'
            )
        return gpus


@dataclass(kw_only=True, slots=True)
class ValidationConfig:
    """TOML section [validation]: greedy decoding on a fixed held-out prompt set."""

    interval: int = 10
    """Validate every this many RL steps (and before the first); 0 disables."""
    num_samples: int = 64
    """Held-out prompts; the same ones every time."""
    max_tokens: int = 64
    """Tokens per turn when validating."""

    def validate(self) -> None:
        if self.interval < 0:
            raise ValueError(f"validation.interval must be >= 0, got {self.interval}")
        if self.num_samples < 1:
            raise ValueError(f"validation.num_samples must be >= 1, got {self.num_samples}")
        check_range("validation.max_tokens", self.max_tokens, ge=1)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """TOML section [checkpoint]. Checkpoints live in <output_dir>/<run_name>/checkpoints/;
    starting a run whose folder holds one continues from the latest complete one."""

    interval: int = 0
    """Save trainer and controller state every this many RL steps, and after the last step
    of the run (training.steps or training.stop_after); 0 disables checkpoints."""
    keep_latest: int = 2
    """How many complete checkpoints to keep (>= 1); older ones are deleted."""
    export_hf: bool = False
    """Also write the policy as a Hugging Face folder (hf/) inside each checkpoint. The end
    of every run writes one to <output_dir>/<run_name>/hf/ regardless."""
    export_dtype: DtypeName = "float32"
    """Dtype of exported Hugging Face weights: "float32" (exact) or "bfloat16" (half size)."""

    def validate(self) -> None:
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval must be >= 0, got {self.interval}")
        if self.keep_latest < 1:
            raise ValueError(f"checkpoint.keep_latest must be >= 1, got {self.keep_latest}")
        if self.export_dtype not in DTYPE_NAMES:
            raise ValueError(
                f"checkpoint.export_dtype must be one of {DTYPE_NAMES}, got {self.export_dtype!r}"
            )


def check_lengths(*, model_max_seq_len: int, batcher_seq_len: int, tp: int = 1) -> None:
    """Cross-section length rules a single section cannot check; ValueError names both keys.

    The trainer's rotary cache covers model.max_seq_len positions and a packed row holds one
    document of up to batcher.seq_len positions, so the row must fit the model. Under
    tensor parallelism rows are sequence-sharded between blocks, so tp must divide them.
    """
    if batcher_seq_len % tp:
        raise ValueError(
            f"batcher.seq_len={batcher_seq_len} must be a multiple of parallelism.tp={tp}"
        )
    if batcher_seq_len > model_max_seq_len:
        raise ValueError(
            f"batcher.seq_len={batcher_seq_len} exceeds model.max_seq_len={model_max_seq_len}; "
            "raise model.max_seq_len or lower batcher.seq_len"
        )
