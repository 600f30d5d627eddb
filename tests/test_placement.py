"""GPU placement: a pure function of the GPU count and the config, checked before any process
starts; each generator sees its GPU as cuda:0 with the others after it; the run records
where every process ran."""

from __future__ import annotations

import json

import pytest

from torchtitan_rl.config import load_config
from torchtitan_rl.config.job import ParallelismConfig
from torchtitan_rl.controller.placement import Placement, place, plan
from torchtitan_rl.controller.processes import process_lines, write_processes


@pytest.mark.parametrize(
    "gpus, trainer, replicas, mode, expected",
    [
        (1, 1, 1, "auto", ((0,), (0,))),  # one GPU: both jobs on it (today's 1-GPU runs)
        (2, 1, 1, "auto", ((0,), (1,))),  # a second GPU: the generator takes it
        (4, 1, 3, "auto", ((0,), (1, 2, 3))),
        (4, 2, 2, "auto", ((0, 1), (2, 3))),  # FSDP over 2 + 2 generator GPUs
        (2, 1, 3, "auto", ((0,), (1, 1, 1))),  # too few for split: the spare GPU takes all
        (4, 2, 3, "auto", ((0, 1), (2, 3, 2))),  # one each while they last, then turns
        (2, 2, 1, "auto", ((0, 1), (0,))),  # no spare GPU: shared
        (4, 2, 3, "shared", ((0, 1), (0, 1, 0))),  # round robin over the trainer's GPUs
        (2, 1, 1, "shared", ((0,), (0,))),  # the 1-GPU baseline on a 2-GPU host
        (8, 4, 2, "split", ((0, 1, 2, 3), (4, 5))),  # spare GPUs stay idle
        (0, 2, 2, "split", ((), ())),  # CPU: no placement
    ],
)
def test_placement_over_a_fake_gpu_count(gpus, trainer, replicas, mode, expected):
    p = place(gpus=gpus, trainer_procs=trainer, replicas=replicas, mode=mode)
    assert (p.trainer, p.generators, p.gpus) == (*expected, gpus)
    assert p.split == (not set(expected[0]) & set(expected[1]))


def test_placement_describes_itself_in_one_line():
    p = place(gpus=4, trainer_procs=2, replicas=2, mode="auto")
    assert p.describe() == "trainer GPUs 0,1; generator GPUs 2,3 (split)"
    assert Placement(trainer=(0,), generators=(0,)).describe().endswith("(shared)")
    assert Placement().describe().startswith("CPU")


@pytest.mark.parametrize(
    "gpus, trainer, replicas, mode, message",
    [
        (2, 3, 1, "auto", "parallelism.trainer_procs=3 needs one GPU per trainer process, "
         "but 2 GPU(s) are visible"),
        (2, 1, 2, "split", 'parallelism.placement = "split" needs parallelism.trainer_procs '
         "+ generator.num_replicas = 1 + 2 GPUs, but 2 are visible"),
        (2, 2, 1, "split", "= 2 + 1 GPUs, but 2 are visible"),
    ],
)  # fmt: skip
def test_more_gpus_asked_than_exist_is_one_line(gpus, trainer, replicas, mode, message):
    with pytest.raises(ValueError) as e:
        place(gpus=gpus, trainer_procs=trainer, replicas=replicas, mode=mode)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.usefixtures("package_logger_restored")
def test_a_split_too_big_for_the_host_stops_the_run_before_any_process(
    tmp_path, monkeypatch, capsys
):
    from torchtitan_rl.train import main

    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setenv("CONFIG_FILE", "train_configs/alphabet_sort_tiny.toml")
    argv = [
        f"--job.output_dir={tmp_path}",
        "--parallelism.trainer_procs=1",
        "--parallelism.placement=split",
        "--generator.num_replicas=2",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert 'parallelism.placement = "split" needs' in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # nothing written, nothing spawned


def test_placement_key_is_read_from_the_config_and_checked():
    config = load_config(
        "train_configs/alphabet_sort_tiny.toml", ["--parallelism.placement=shared"]
    )
    assert config.parallelism.placement == "shared"
    monkey = ParallelismConfig(trainer_procs=1, device="cpu", placement="split")
    assert plan(monkey, 5) == Placement()  # CPU: no GPUs, nothing to place
    with pytest.raises(Exception, match="parallelism.placement"):
        load_config("train_configs/alphabet_sort_tiny.toml", ["--parallelism.placement=spread"])


def test_the_summary_lists_each_process_and_its_gpu(tmp_path):
    processes = [
        {"role": "trainer", "rank": 0, "host": "h", "pid": 11, "device": "cuda:0", "gpu": 0,
         "uuid": "GPU-aaa", "peak_reserved_gib": 41.2},
        {"role": "generator", "rank": 0, "host": "h", "pid": 12, "device": "cuda:0", "gpu": 1,
         "uuid": "GPU-bbb", "peak_reserved_gib": 52.81},
    ]  # fmt: skip
    write_processes(tmp_path, processes)
    assert json.loads((tmp_path / "processes.json").read_text()) == processes
    lines = process_lines(tmp_path)
    assert lines[0].startswith("procs    trainer rank 0") and "GPU 0 GPU-aaa" in lines[0]
    assert "generator" in lines[1] and "GPU 1 GPU-bbb  peak 52.81 GiB" in lines[1]
    assert process_lines(tmp_path / "nothing") == []


def test_the_vllm_backend_shares_gpu_0_and_refuses_split(monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    par = ParallelismConfig(trainer_procs=1, device="cuda")
    assert plan(par, 2, "native") == Placement(trainer=(0,), generators=(1, 2), gpus=4)
    assert plan(par, 2, "vllm") == Placement(trainer=(0,), generators=(0, 0), gpus=4)
    par.placement = "split"
    with pytest.raises(ValueError, match='"split" is not available with generator.backend'):
        plan(par, 1, "vllm")


@pytest.mark.usefixtures("package_logger_restored")
def test_simulated_hosts_on_a_gpu_machine_stop_before_any_process(tmp_path, monkeypatch, capsys):
    from torchtitan_rl.train import main

    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setenv("CONFIG_FILE", "train_configs/alphabet_sort_tiny.toml")
    argv = [f"--job.output_dir={tmp_path}", "--parallelism.trainer_procs=2",
            "--launcher.kind=process", "--launcher.trainer_hosts=2"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert 'launcher.kind = "process" simulates hosts on one machine' in err
    assert not any(tmp_path.iterdir())


def test_a_process_that_outlives_its_mesh_is_killed_and_a_reused_pid_is_not(caplog):
    """The one-host close: a run's process still running after the grace is SIGKILLed and
    logged; a record whose start time is not the running process's (its pid was reused) is
    left alone, as is one that exits within the grace, and the controller's own process."""
    import asyncio
    import os
    import socket
    import subprocess

    from torchtitan_rl.controller.processes import kill_leftovers, on_this_machine, started

    host = socket.gethostname()
    stuck, reused, quitting = (subprocess.Popen(["sleep", s]) for s in ("60", "60", "0.3"))
    records = [{"role": "generator", "host": host, "pid": p.pid, "device": "cpu"}
               for p in (stuck, reused, quitting)]  # fmt: skip
    records.append({"role": "generator", "host": "elsewhere", "pid": stuck.pid, "device": "cpu"})
    records.append(
        {"role": "trainer", "rank": 0, "host": host, "pid": os.getpid(), "device": "cpu"}
    )
    local = on_this_machine(records)
    assert [w["pid"] for w, _ in local] == [stuck.pid, reused.pid, quitting.pid]
    local[1] = (local[1][0], local[1][1] + 1)  # another process once had this pid
    try:
        killed = asyncio.run(kill_leftovers(local, grace_s=1.0))
        assert [w["pid"] for w in killed] == [stuck.pid]
        assert stuck.wait(timeout=5) == -9 and quitting.wait(timeout=5) == 0
        assert reused.poll() is None and started(reused.pid) is not None
        assert "did not stop with its mesh" in caplog.text
    finally:
        for p in (stuck, reused):
            p.kill()
            p.wait()


def test_a_jobs_replicas_take_the_next_free_gpu_of_their_host():
    from torchtitan_rl.controller.placement import plan_hosts

    # 5 replicas over 2 generator hosts: host 0 holds replicas 0, 2, 4 on its GPUs 0, 1, 2
    placement = plan_hosts(replicas=5, generator_hosts=2, on_gpus=True)
    assert placement.generators == (0, 0, 1, 1, 2) and placement.gpus == 3
    assert plan_hosts(replicas=5, generator_hosts=2, on_gpus=False) == Placement()
