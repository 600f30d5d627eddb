"""A simulated generator host that dies whole (its host process and the processes it started,
SIGKILL) ends a several-host run within seconds, with one line naming the mesh, the host and
the step; the last complete checkpoint loads; no process of any host is left running."""

import asyncio
import os
import signal
import time

import pytest
import torch
from fakes import run_until_a_kill_ends_it
from test_hosts_end_to_end import HOSTS, _alive, _config

from torchtitan_rl.controller.checkpoints import CheckpointStore
from torchtitan_rl.controller.loop import Controller


def _kill_host(host_pid: int) -> list[int]:
    """SIGKILL every process of the host's session (the host and what it spawned)."""
    killed = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == host_pid:
                    os.kill(int(entry), signal.SIGKILL)
                    killed.append(int(entry))
            except OSError:
                pass
    return killed


@pytest.mark.slow
def test_a_dead_generator_host_ends_the_run_with_one_line_naming_it(tmp_path):
    config = _config(
        tmp_path, "faulty", *HOSTS, "--training.steps=60", "--checkpoint.interval=1",
        "--launcher.host_timeout_s=3",
    )  # fmt: skip
    controller = Controller(config, use_tqdm=False)
    pids: list[int] = []

    async def kill_generator_host_after_a_checkpoint():
        store = CheckpointStore(controller.run_dir, keep_latest=2)
        while store.latest() is None:
            await asyncio.sleep(0.2)
        hosts = controller.meshes.job._host_to_pid
        pids.extend(p.pid for p in hosts.values())
        pids.extend((await controller.trainer.pid.call()).values())
        pids.append(await controller.fleet.actors[0].pid.call_one())
        assert _kill_host(hosts["generator_0"].pid)
        return time.perf_counter()

    message, seconds = asyncio.run(
        run_until_a_kill_ends_it(controller, kill_generator_host_after_a_checkpoint)
    )
    assert message.startswith("generator failed during RL step ") and "\n" not in message
    assert "(rank 0 on host generator_0): its host stopped answering" in message, message
    assert seconds < 30, f"noticed {seconds:.0f} s after the kill"
    left = [p for p in pids if _alive(p)]
    assert not left, f"still running on the other hosts: {left}"
    # the last complete checkpoint loads (into one process: DCP reshards)
    from torchtitan_rl.models.tokenizer import Tokenizer
    from torchtitan_rl.training.checkpoint import load_trainer_state
    from torchtitan_rl.training.trainer import TrainerCore

    latest = CheckpointStore(controller.run_dir, keep_latest=2).latest()
    core = TrainerCore(
        model_config=config.model, training=config.training, loss=config.loss,
        correction=config.correction, vocab_size=Tokenizer.from_file(None).vocab_size,
        device=torch.device("cpu"), seed=1,
    )  # fmt: skip
    assert load_trainer_state(core, latest / "trainer") == int(latest.name.split("_")[1])
