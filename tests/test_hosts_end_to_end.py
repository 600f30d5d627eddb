"""Several hosts through Monarch's ProcessJob: the trainer on 2 simulated hosts (FSDP over gloo
across them, one process each) and the generator on a third, 3 RL steps. After every sync the
generator computes with the trainer's weights bit for bit, the weights never pass through the
controller (a broadcast group), every number of every step equals the same job on one host,
and closing leaves no host process running. Replicas spread over two generator hosts each
get the broadcast."""

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from torchtitan_rl.config import load_config
from torchtitan_rl.controller.loop import Controller
from torchtitan_rl.weight_sync.config import AUTO_BY_BACKEND

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from compare_runs import CLOCK_TAGS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOSTS = ("--launcher.kind=process", "--launcher.trainer_hosts=2", "--launcher.generator_hosts=1")


def _config(tmp_path, name, *extra):
    return load_config(
        ROOT / "train_configs" / "alphabet_sort_tiny.toml",
        [
            f"--job.output_dir={tmp_path}",
            f"--job.run_name={name}",
            "--env.name=hosts_env:EvenTokens",  # a reward every sampled token moves
            "--training.steps=3",
            "--training.lr=0.01",
            "--warm_start.steps=0",
            "--rollout.group_size=4",
            "--rollout.prompts_per_step=2",
            "--rollout.max_tokens=12",
            "--rollout.filter_zero_std_groups=false",
            "--validation.interval=0",
            # one request at a time: a forward's batch then never depends on timing, so the
            # generator's fp32 log-probs (pi_old here) are the same in every run, bit for bit
            "--generator.max_num_seqs=1",
            "--generator.num_replicas=1",
            "--parallelism.trainer_procs=2",
            "--training.minibatches=1",
            *extra,
        ],
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


async def _scenario(config):
    controller = Controller(config, use_tqdm=False)
    steps, equal, pids = [], [], []
    try:
        await controller.start()
        await controller.warm_start()
        pids = [
            *(await controller.trainer.pid.call()).values(),
            await controller.fleet.actors[0].pid.call_one(),
        ]
        job = controller.meshes.job
        pids += [p.pid for p in job._host_to_pid.values()] if job is not None else []
        for step in (1, 2, 3):
            steps.append(await controller.rl_step(step))
            out = await controller.trainer.full_weights.call("float32")  # torch's own gather
            trainer = [w for w in out.values() if w is not None][0]
            generator = await controller.fleet.actors[0].weights.call_one()
            assert sorted(generator) == sorted(trainer)
            equal.append([k for k in trainer if not torch.equal(trainer[k], generator[k])])
        return dict(
            steps=steps,
            differ=equal,
            transport=controller.fleet.weight_sync.transport,
            hosts=dict(controller.meshes.hosts),
            version=await controller.fleet.actors[0].policy_version.call_one(),
        )
    finally:
        await controller.close()
        left = [p for p in pids if _alive(p)]
        assert not left, f"processes still running after close: {left}"


def _is_timing(key: str) -> bool:
    """Wall-clock metrics (perf/*, generator/*_ms, the engines' step counts, ...): they differ
    between any two runs."""
    clock = key.startswith("perf/") or "_ms" in key or "seconds" in key or "per_second" in key
    return clock or any(c in key for c in CLOCK_TAGS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hosts")
    # the one-host run sends its weights through the controller (weight_sync.transport),
    # the several-host run broadcasts them: the numbers must not depend on the transport
    local = asyncio.run(_scenario(_config(tmp, "local", "--weight_sync.transport=controller")))
    hosts = asyncio.run(_scenario(_config(tmp, "hosts", *HOSTS)))
    return local, hosts


@pytest.mark.slow
def test_the_generator_holds_the_trainer_weights_after_every_sync_across_hosts(runs):
    _, hosts = runs
    assert hosts["hosts"] == {
        "trainer": ["trainer_0", "trainer_1"],
        "generator": ["generator_0"],
    }
    assert hosts["transport"] == AUTO_BY_BACKEND["gloo"]
    assert hosts["differ"] == [[], [], []], "tensors that differ after syncs 1, 2, 3"
    assert hosts["version"] == 3
    assert [m["trainer/policy_version"] for m in hosts["steps"]] == [1, 2, 3]


@pytest.mark.slow
def test_every_step_number_equals_the_same_job_on_one_host(runs):
    local, hosts = runs
    assert local["transport"] == "controller" and local["differ"] == [[], [], []]
    rewards = [m["rollout_reward/mean"] for m in hosts["steps"]]
    assert all(0 < r < 1 for r in rewards), rewards  # a real signal, not a constant
    for one, several in zip(local["steps"], hosts["steps"]):
        keys = sorted(k for k in one if not _is_timing(k))
        assert keys == sorted(k for k in several if not _is_timing(k))
        assert "loss/mean" in keys and "trainer/grad_norm" in keys
        assert {k: one[k] for k in keys} == {k: several[k] for k in keys}


@pytest.mark.slow
def test_replicas_spread_over_generator_hosts_and_each_gets_the_broadcast(tmp_path):
    config = _config(
        tmp_path, "spread", "--launcher.kind=process", "--launcher.generator_hosts=2",
        "--generator.num_replicas=2", "--parallelism.trainer_procs=1", "--training.steps=1",
        "--generator.max_num_seqs=4",
    )  # fmt: skip

    async def scenario():
        controller = Controller(config, use_tqdm=False)
        try:
            await controller.start()
            await controller.rl_step(1)
            out = await controller.trainer.full_weights.call("float32")
            trainer = [w for w in out.values() if w is not None][0]
            replicas = [await g.weights.call_one() for g in controller.fleet.actors]
            return dict(
                hosts=dict(controller.meshes.hosts),
                transport=controller.fleet.weight_sync.transport,
                routed=list(controller.fleet.router.routed),
                differ=[
                    [k for k in trainer if not torch.equal(trainer[k], w[k])] for w in replicas
                ],
                versions=[await g.policy_version.call_one() for g in controller.fleet.actors],
            )
        finally:
            await controller.close()

    r = asyncio.run(scenario())
    assert r["hosts"] == {
        "trainer": ["trainer_0"],
        "generator": ["generator_0"],
        "generator1": ["generator_1"],
    }
    assert r["transport"] == AUTO_BY_BACKEND["gloo"]
    assert r["differ"] == [[], []] and r["versions"] == [1, 1]
    assert min(r["routed"]) > 0, "the router used the replicas on both hosts"
