"""The [weight_sync] section: how trainer rank 0's weights reach the generators.

    [weight_sync]
    transport = "auto"      # "auto" | "cuda_ipc" | "broadcast" | "delta" | "controller"

Its own section rather than a [launcher] key: the transport is a property of the weight sync
(weight_sync/transport.py), not of where hosts come from; "auto" already follows the hosts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

TransportChoice = Literal["auto", "cuda_ipc", "broadcast", "delta", "controller"]
TRANSPORT_CHOICES = get_args(TransportChoice)

AUTO_BY_BACKEND: dict[str, str] = {"gloo": "broadcast", "nccl": "broadcast"}
"""What "auto" picks when the generators cannot open rank 0's GPU (CUDA IPC), by the
backend the group would use: the faster transport as measured by
scripts/bench_weight_sync.py (docs/benchmarks.md, "Delta weight sync"; 0.6B shape, bf16,
1.19 GB). gloo: the whole buffer (0.9-2.2 s per sync on two simulated hosts) beat the delta
(2.9-7.6 s, 4.3-7.1x fewer bytes, its CPU codec the cost). nccl: the whole buffer (21 ms
from GPU 0 to GPU 1 over NVLink) beat the delta (30-35 ms, its GPU codec the cost); between
GPU hosts on a slow link the delta may win, which is not measured."""


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """TOML section [weight_sync]."""

    transport: TransportChoice = "auto"
    """"auto": "cuda_ipc" where every generator shares rank 0's host and sees its GPU, else
    the group transport measured faster for its backend (AUTO_BY_BACKEND). "cuda_ipc": CUDA
    IPC handles to rank 0's GPU buffer (one host, GPUs). "broadcast": a process group of
    rank 0 and the generators (NCCL when each of them is on a GPU of its own, else gloo), the
    whole buffer each sync. "delta": the same group, sending a bitmask of the changed
    elements plus their values (a full send when a generator lacks the last version).
    "controller": through the controller process (slowest; for debugging). "auto" falls back
    to "controller" (one warning line) when its pick cannot open; a transport set by name is
    refused before the run starts where it cannot work ("cuda_ipc" on CPU or across hosts)
    and ends the run in one line when it cannot open."""

    def validate(self) -> None:
        if self.transport not in TRANSPORT_CHOICES:
            raise ValueError(
                f"weight_sync.transport must be one of {TRANSPORT_CHOICES}; got {self.transport!r}"
            )

    def check_run(self, *, on_gpus: bool, one_host: bool) -> None:
        """ValueError (one line: the key, why, the values valid here) when the transport set
        cannot work in a run with these processes: "cuda_ipc" needs trainer rank 0 and every
        generator on GPUs of one host (`on_gpus`, `one_host`: launcher.kind = "local")."""
        if self.transport != "cuda_ipc" or (on_gpus and one_host):
            return
        why = "this run is on CPU" if not on_gpus else "this run puts them on hosts of their own"
        valid = ", ".join(f'"{t}"' for t in TRANSPORT_CHOICES if t != "cuda_ipc")
        raise ValueError(
            f'weight_sync.transport = "cuda_ipc" needs trainer rank 0 and every generator on '
            f"GPUs of one host, and {why}; valid here: {valid}"
        )
