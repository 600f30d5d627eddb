"""The [launcher] section: each mistake is one line naming the key, and each key reaches the
Monarch job it configures (built here, never submitted: no Slurm or Kubernetes cluster is
reachable from this machine). Failure lines name the host of a dead rank."""

import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_rl.config import ConfigError, help_text, load_config
from torchtitan_rl.config.launcher import LauncherConfig
from torchtitan_rl.controller.hosts import build_job, gpus_per_host, kubernetes_meshes, watch_hosts
from torchtitan_rl.controller.supervision import describe_failure

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "train_configs" / "alphabet_sort_tiny.toml"


@pytest.fixture
def monarch_settings():
    """SlurmJob and KubernetesJob switch this process's Monarch transport to TCP, and
    `watch_hosts` sets timeouts: put the settings back for the tests that follow."""
    from monarch._rust_bindings.monarch_hyperactor import config

    before = config.get_runtime_config()
    yield config
    config.clear_runtime_config()
    if before:
        config.configure(**before)


def _job(monarch_settings, *overrides):
    cfg = load_config(TINY, list(overrides))
    return build_job(cfg.launcher, cfg.parallelism, cfg.generator.num_replicas)


def test_the_default_is_this_host_and_help_lists_the_section():
    cfg = load_config(TINY)
    assert cfg.launcher.kind == "local" and not cfg.launcher.multi_host
    assert (cfg.launcher.trainer_hosts, cfg.launcher.generator_hosts) == (1, 1)
    text = help_text(cfg)
    assert 'launcher.kind ("local" | "process" | "slurm" | "kubernetes") = "local"' in text
    assert "launcher.slurm_partition" in text and "launcher.kubernetes_image" in text


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["--launcher.kind=ssh"], "launcher.kind must be one of 'local', 'process', 'slurm'"),
        (["--launcher.trainer_hosts=2"], 'launcher.kind = "local" runs on this one host'),
        (
            ["--launcher.kind=process", "--launcher.generator_hosts=0"],
            "generator_hosts must be >= 1",
        ),
        (
            ["--launcher.kind=process", "--launcher.trainer_hosts=3"],
            "parallelism.trainer_procs=2 must divide evenly over launcher.trainer_hosts=3",
        ),
        (
            ["--launcher.kind=process", "--launcher.trainer_hosts=2", "--parallelism.tp=2"],
            "parallelism.tp=2 must divide the trainer processes per host (2/2)",
        ),
        (
            ["--launcher.kind=process", "--launcher.generator_hosts=2"],
            "launcher.generator_hosts=2 exceeds generator.num_replicas=1",
        ),
        (["--launcher.kind=slurm", "--launcher.slurm_time_limit=4h"], "slurm_time_limit must look"),
        (["--launcher.kind=kubernetes"], "needs launcher.kubernetes_namespace"),
        (
            ["--launcher.kind=kubernetes", "--launcher.kubernetes_namespace=My_NS"],
            "needs launcher.kubernetes_namespace",
        ),
        (["--launcher.host_timeout_s=0"], "launcher.host_timeout_s must be >= 1, got 0"),
        (
            ["--launcher.weight_transport=broadcast"],
            "launcher.weight_transport moved to weight_sync.transport; set "
            'weight_sync.transport = "broadcast"',
        ),
        (
            ["--weight_sync.transport=nccl"],
            "weight_sync.transport must be one of 'auto', 'cuda_ipc', 'broadcast', 'delta', "
            "'controller'; got 'nccl'",
        ),
        (["--launcher.start_timeout_s=-1"], "launcher.start_timeout_s must be >= 0, got -1"),
    ],
)
def test_launcher_mistakes_are_one_line_naming_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_cli_launcher_mistake_exits_2_with_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "torchtitan_rl.train", f"--job.output_dir={tmp_path}",
         "--launcher.kind=process", "--launcher.trainer_hosts=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, lines
    assert "launcher.trainer_hosts=3" in lines[0] and "Traceback" not in run.stderr


def test_process_kind_builds_a_process_job_with_one_host_mesh_per_role(monarch_settings):
    from monarch._src.job.process import ProcessJob

    job = _job(monarch_settings, "--launcher.kind=process", "--launcher.trainer_hosts=2")
    assert isinstance(job, ProcessJob) and not job.active  # built, nothing started
    assert job._meshes == {"trainer": 2, "generator": 1}


def test_slurm_kind_passes_every_slurm_key_to_the_slurm_job(monarch_settings):
    from monarch._src.job.slurm import SlurmJob

    job = _job(
        monarch_settings,
        "--launcher.kind=slurm",
        "--launcher.trainer_hosts=2",
        "--parallelism.trainer_procs=8",
        "--parallelism.device=cuda",
        "--generator.num_replicas=3",
        "--launcher.slurm_partition=h100",
        "--launcher.slurm_time_limit=1-04:00:00",
        "--launcher.slurm_account=rl-team",
        "--launcher.slurm_python_exe=/opt/rl/bin/python",
        "--launcher.start_timeout_s=900",
    )
    assert isinstance(job, SlurmJob) and not job.active  # nothing submitted
    assert job._meshes == {"trainer": 2, "generator": 1}
    assert (job._partition, job._time_limit, job._account) == ("h100", "1-04:00:00", "rl-team")
    assert job._python_exe == "/opt/rl/bin/python" and job._job_start_timeout == 900
    assert job._gpus_per_node == 4  # 8 trainer procs over 2 hosts; 3 replicas on 1 host: 3
    defaults = _job(monarch_settings, "--launcher.kind=slurm", "--parallelism.device=cpu")
    assert defaults._partition is None and defaults._time_limit is None
    assert defaults._account is None and defaults._job_start_timeout is None
    assert defaults._gpus_per_node is None  # CPU: no GPUs asked for


def test_gpus_per_host_is_the_busier_role_on_gpus_and_none_on_cpu():
    cfg = load_config(TINY, ["--launcher.kind=process", "--generator.num_replicas=3"])
    launcher, parallelism = cfg.launcher, cfg.parallelism
    parallelism.device = "cuda"
    assert gpus_per_host(launcher, parallelism, 3) == 3  # 3 replicas on the one generator host
    launcher.generator_hosts = 2
    assert gpus_per_host(launcher, parallelism, 3) == 2  # 2 + 1 replicas; 2 trainer procs
    parallelism.device = "cpu"
    assert gpus_per_host(launcher, parallelism, 3) is None


def test_kubernetes_without_its_client_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "kubernetes" else real(name)
    )
    with pytest.raises(ConfigError, match=r"needs the kubernetes Python client, which is not"):
        load_config(TINY, ["--launcher.kind=kubernetes", "--launcher.kubernetes_namespace=rl"])


def test_kubernetes_keys_reach_the_meshes_the_job_adds():
    launcher = LauncherConfig(
        kind="kubernetes",
        kubernetes_namespace="rl",
        kubernetes_image="ghcr.io/me/rl:1",
        trainer_hosts=2,
    )
    meshes = kubernetes_meshes(launcher, gpus=1)
    assert meshes == {
        "trainer": {"num_replicas": 2, "image": "ghcr.io/me/rl:1",
                    "resources": {"nvidia.com/gpu": 1}},
        "generator": {"num_replicas": 1, "image": "ghcr.io/me/rl:1",
                      "resources": {"nvidia.com/gpu": 1}},
    }  # fmt: skip
    launcher.kubernetes_image = ""  # attach to running pods: nothing to provision
    assert kubernetes_meshes(launcher, gpus=1)["trainer"]["resources"] is None


def test_kubernetes_kind_builds_a_kubernetes_job(monarch_settings):
    pytest.importorskip("kubernetes")
    from monarch._src.job.kubernetes import KubernetesJob

    overrides = [
        "--launcher.kind=kubernetes",
        "--launcher.kubernetes_namespace=rl",
        "--launcher.trainer_hosts=2",
        "--launcher.start_timeout_s=600",
        "--parallelism.device=cuda",
    ]
    job = _job(monarch_settings, *overrides, "--launcher.kubernetes_image=ghcr.io/me/rl:1")
    assert isinstance(job, KubernetesJob) and not job.active
    assert job._namespace == "rl" and job._timeout == 600
    trainer = job._meshes["trainer"]
    assert trainer["num_replicas"] == 2 and trainer["provisioned"]
    assert trainer["image_spec"].image == "ghcr.io/me/rl:1"
    assert trainer["image_spec"].resources == {"nvidia.com/gpu": 1}
    attach = _job(monarch_settings, *overrides)
    assert not attach._meshes["generator"]["provisioned"]
    assert "mesh-name=generator" in attach._meshes["generator"]["label_selector"]


def test_host_timeout_sets_how_long_monarch_waits_for_a_silent_host(monarch_settings):
    cfg = load_config(TINY, ["--launcher.kind=process", "--launcher.host_timeout_s=7"])
    watch_hosts(cfg.launcher)
    settings = monarch_settings.get_runtime_config()
    assert str(settings["get_actor_state_max_idle"]) == str(settings["get_proc_state_max_idle"])
    assert "7s" in str(settings["get_proc_state_max_idle"])


HOST_DIED = (
    "Endpoint call generator1.generate() failed, Supervision event: actor <root>.<torchtitan_rl"
    ".actors.generator.GeneratorActor generator1{'procs': 0/1}> has status:\n"
    "  stopped: no status received from process"
)
TRAINER_DIED = (
    "The actor <root>.<torchtitan_rl.actors.trainer.TrainerActor trainer{'hosts': 1/2, "
    "'procs': 1/2}> and all its descendants have failed:\n"
    "  the process this actor was running on failed: Killed(sig=9)"
)


def test_a_failure_line_names_the_host_of_the_dead_rank():
    hosts = {
        "trainer": ["trainer_0", "trainer_0", "trainer_1", "trainer_1"],
        "generator": ["generator_0"],
        "generator1": ["generator_1"],
    }
    names = ("trainer", "generator", "generator1")
    assert describe_failure(HOST_DIED, names, "during RL step 2", hosts) == (
        "generator1 failed during RL step 2 (rank 0 on host generator_1): its host stopped "
        "answering (stopped: no status received from process)"
    )
    assert describe_failure(TRAINER_DIED, names, "during RL step 5", hosts).startswith(
        "trainer failed during RL step 5 (rank 3 on host trainer_1): "
    )
    assert describe_failure(TRAINER_DIED, names, "x").startswith("trainer failed x (rank 3): ")


class _Failure:
    def __init__(self, text):
        self.text = text

    def report(self):
        return self.text


LOGGER_DIED = (
    "The actor logger-tTVtQ3vHas1{'procs': 0/1} and all its descendants have failed:\n"
    "  the process this actor was running on failed: Killed(sig=9)"
)


@pytest.mark.parametrize("reported", [True, False])
@pytest.mark.parametrize("opening", [False, True])
def test_a_broken_weight_broadcast_is_named_by_the_death_that_broke_it(
    monkeypatch, reported, opening
):
    """The trainer's broadcast fails at once when a generator dies; Monarch's report of the
    death comes seconds later (its own logger actor's first): the line names the generator.
    Without any report, the broadcast's own one-line error stands. The same when a named
    transport could not be opened because a member died while the group formed."""
    import asyncio
    import threading

    from torchtitan_rl.controller import supervision
    from torchtitan_rl.controller.supervision import ActorFailure, Supervisor
    from torchtitan_rl.weight_sync.broadcast import BroadcastBroken
    from torchtitan_rl.weight_sync.transport import TransportUnavailable

    monkeypatch.setattr(supervision, "PEER_REPORT_WAIT_S", 3.0)
    sup = Supervisor(("trainer", "generator", "generator1"))
    sup.hosts = {"generator1": ["generator_1"]}
    error = TransportUnavailable if opening else BroadcastBroken

    async def broken_sync():
        raise error("the weight broadcast failed: Connection closed by peer")

    async def scenario():
        sup.install()
        try:
            sup.where = "during RL step 4"
            if reported:
                for delay, text in ((0.2, LOGGER_DIED), (0.6, HOST_DIED)):
                    threading.Timer(delay, sup._on_failure, [_Failure(text)]).start()
            await sup.watch(broken_sync())
        finally:
            sup.uninstall()

    if reported:
        with pytest.raises(ActorFailure, match=r"^generator1 failed during RL step 4 \(rank 0 on "
                           r"host generator_1\): its host stopped answering"):  # fmt: skip
            asyncio.run(scenario())
    else:
        with pytest.raises(error, match="Connection closed by peer"):
            asyncio.run(scenario())


class _UnreachableJob:
    """A job whose hosts never come up (as SlurmJob where sbatch is missing)."""

    killed = False

    def state(self, cached_path):
        raise FileNotFoundError("[Errno 2] No such file or directory: 'sbatch'")

    def kill(self):
        self.killed = True


def test_hosts_that_do_not_come_up_are_one_line_naming_the_kind(monarch_settings):
    import asyncio

    from torchtitan_rl.controller.hosts import launch_job

    cfg = load_config(TINY, ["--launcher.kind=slurm"])
    job = _UnreachableJob()
    with pytest.raises(RuntimeError) as e:
        asyncio.run(launch_job(cfg, replicas=1, job=job))
    assert str(e.value) == (
        'launcher.kind = "slurm": the job\'s hosts did not come up: FileNotFoundError: '
        "[Errno 2] No such file or directory: 'sbatch'"
    )
    assert job.killed
