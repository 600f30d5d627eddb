"""Two GPUs (issue 30), 3 RL steps through Monarch; after every sync the generator holds the
trainer's weights bit for bit (CUDA IPC), for both generator backends:
- native: the trainer on GPU 0, the generator on GPU 1 (the copy crosses GPUs);
- vllm: FSDP over GPUs 0 and 1, vLLM on GPU 0 (it starts its engine on the first GPU, so
  the placement shares; the sync gathers across both GPUs).
Marked `gpu`; skipped with fewer than 2 GPUs (the vLLM case also without vLLM)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)

from torchtitan_rl.config import load_config  # noqa: E402
from torchtitan_rl.controller.loop import Controller  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def vllm_layout(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face Qwen3 weights in vLLM's fused layout: q, k, v stacked into qkv_proj;
    gate and up into gate_up_proj; the rest by name."""
    out = {}
    for name, t in hf.items():
        if ".q_proj." in name:
            k, v = (hf[name.replace(".q_proj.", p)] for p in (".k_proj.", ".v_proj."))
            out[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat([t, k, v])
        elif ".gate_proj." in name:
            up = hf[name.replace(".gate_proj.", ".up_proj.")]
            out[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([t, up])
        elif not any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[name] = t
    return out


def expected_weights(trainer_state: dict, backend: str, model_args) -> dict[str, torch.Tensor]:
    """What the generator should hold: the trainer's weights under the backend's names."""
    if backend == "native":
        return trainer_state
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    return vllm_layout(Qwen3StateDictAdapter(model_args, None).to_hf(trainer_state))


def assert_same_weights(held: dict, expected: dict) -> int:
    """Every tensor the generator holds equals the expected one bit for bit (vLLM may pad
    the vocabulary rows); returns how many were compared."""
    compared = 0
    for name, t in held.items():
        if name not in expected:
            assert name == "lm_head.weight", f"unexpected generator weight {name}"
            continue  # tied: vLLM's lm_head is the embedding, compared under its own name
        want = expected[name]
        assert t.dtype == want.dtype, name
        assert torch.equal(t[: want.shape[0]], want), name
        compared += 1
    assert compared >= len(expected) - 1
    return compared


@pytest.mark.parametrize(
    "backend, transport",
    [
        ("native", "auto"),  # CUDA IPC: the generator opens GPU 0's buffer
        ("native", "broadcast"),  # NCCL from GPU 0 to GPU 1, as between two hosts
        pytest.param("vllm", "auto", marks=pytest.mark.vllm),
    ],
)
def test_three_rl_steps_on_two_gpus_hold_the_trainer_weights_bit_for_bit(
    tmp_path, backend, transport
):
    if backend == "vllm":
        pytest.importorskip("vllm")
    from torchtitan_rl.models.qwen3 import model_args

    config = load_config(
        ROOT / "train_configs" / "alphabet_sort_tiny.toml",
        [
            f"--job.output_dir={tmp_path}",
            "--parallelism.device=cuda",
            f"--parallelism.trainer_procs={1 if backend == 'native' else 2}",
            f"--parallelism.placement={'split' if backend == 'native' else 'auto'}",
            f"--generator.backend={backend}",
            f"--weight_sync.transport={transport}",
            "--generator.dtype=bfloat16",
            "--generator.max_num_seqs=16",
            "--generator.cuda_graphs=false",
            "--warm_start.steps=2",
            "--warm_start.batch_size=4",
            # 2 warm-start steps leave every group at reward 0: filtered, nothing would
            # train and a step would have no trainer/policy_version
            "--rollout.filter_zero_std_groups=false",
            "--rollout.batch_timeout_s=300",  # a stuck generator says what it was doing
            "--validation.interval=0",
            "--checkpoint.interval=0",
        ],
    )
    controller = Controller(config, use_tqdm=False)
    args = model_args(config.model, controller.tokenizer.vocab_size)

    async def run():
        checks = []
        try:
            await controller.start()
            await controller.warm_start()
            for step in (1, 2, 3):
                m = await controller.rl_step(step)
                out = await controller.trainer.full_weights.call("bfloat16")
                trainer = [w for w in out.values() if w is not None][0]
                held = await controller.fleet.actors[0].weights.call_one()
                version = await controller.fleet.actors[0].policy_version.call_one()
                compared = assert_same_weights(held, expected_weights(trainer, backend, args))
                checks.append((m["trainer/policy_version"], version, compared))
            return checks, controller.fleet.weight_sync.transport
        finally:
            await controller.close()

    async def watched():  # as Controller.run: a dead process ends the test in seconds
        return await controller.supervisor.watch(run())

    checks, chosen = asyncio.run(watched())
    if transport == "auto":
        assert chosen == "cuda_ipc"
    else:
        assert chosen == "broadcast" and controller.fleet.weight_sync.backend == "nccl"
    assert [(p, v) for p, v, _ in checks] == [(3, 3), (4, 4), (5, 5)]
    processes = json.loads((controller.run_dir / "processes.json").read_text())
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(2)]
    expected = [("trainer", 0), ("generator", 1)] if backend == "native" else [
        ("trainer", 0), ("trainer", 1), ("generator", 0)]  # fmt: skip
    assert [(p["role"], p["gpu"]) for p in processes] == expected
    assert [p["uuid"] for p in processes] == [uuids[g] for _, g in expected]  # physical GPUs


def test_a_dead_generator_in_an_nccl_weight_group_ends_the_run_in_seconds(tmp_path):
    """The NCCL fault drill: the generator on GPU 1 is SIGKILLed mid-run while trainer rank 0
    broadcasts to it every step. The run ends within seconds on one line naming the
    generator (not after the broadcast's 600 s timeout), and no process is left."""
    import os
    import signal
    import time

    from fakes import run_until_a_kill_ends_it
    from test_hosts_end_to_end import _alive

    from torchtitan_rl.controller.checkpoints import CheckpointStore

    config = load_config(
        ROOT / "train_configs" / "alphabet_sort_tiny.toml",
        [
            f"--job.output_dir={tmp_path}",
            "--parallelism.device=cuda",
            "--parallelism.trainer_procs=1",
            "--parallelism.placement=split",
            "--weight_sync.transport=broadcast",
            "--generator.max_num_seqs=16",
            "--generator.cuda_graphs=false",
            "--warm_start.steps=2",
            "--warm_start.batch_size=4",
            "--rollout.filter_zero_std_groups=false",
            "--training.steps=200",
            "--validation.interval=0",
            "--checkpoint.interval=2",
        ],
    )
    controller = Controller(config, use_tqdm=False)
    pids: list[int] = []

    async def kill_the_generator_after_a_checkpoint():
        store = CheckpointStore(controller.run_dir, keep_latest=2)
        while store.latest() is None:
            await asyncio.sleep(0.1)
        assert controller.fleet.weight_sync.backend == "nccl"
        pids.extend((await controller.trainer.pid.call()).values())
        generator = await controller.fleet.actors[0].pid.call_one()
        pids.append(generator)
        os.kill(generator, signal.SIGKILL)
        return time.perf_counter()

    message, seconds = asyncio.run(
        run_until_a_kill_ends_it(controller, kill_the_generator_after_a_checkpoint)
    )
    assert message.startswith("generator failed during RL step ") and "\n" not in message
    assert seconds < 30, f"noticed {seconds:.0f} s after the kill"
    left = [p for p in pids if _alive(p)]
    assert not left, f"still running: {left}"
