"""Keys whose effect no other test shows: each test fails if its key were ignored."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import tiny_core, tiny_qwen3

from torchtitan_rl.config.job import ParallelismConfig
from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.models.hf_export import export_hf
from torchtitan_rl.rollout.batcher import BatcherConfig, pack_batch
from torchtitan_rl.types import Episode

VOCAB = 96


def _core(**training):
    return tiny_core(**training)


def _batch():
    rng = np.random.default_rng(0)
    episodes = []
    for i in range(4):
        mask = np.zeros(16, bool)
        mask[8:] = True
        episodes.append(
            Episode(
                token_ids_L=rng.integers(0, VOCAB, 16).astype(np.int32),
                loss_mask_L=mask,
                logprobs_L=np.where(mask, -3.0, 0).astype(np.float32),
                advantages_L=np.where(mask, 1.0 if i % 2 else -1.0, 0).astype(np.float32),
            )
        )
    config = BatcherConfig(seq_len=64, rows_per_microbatch=2)
    return pack_batch(episodes, config=config, num_ranks=1, pad_id=0)[0][0]


def _moved(**training) -> float:
    """How far one RL step moves the weights (L2 over all tensors)."""
    core = _core(**training)
    before = {k: v.clone() for k, v in core.full_state_dict().items()}
    core.train_step([_batch()], 1.0)
    after = core.full_state_dict()
    return sum(float((after[k] - before[k]).norm() ** 2) for k in before) ** 0.5


def test_max_grad_norm_clips_the_update():
    # Adam divides by the gradient's own scale; a gradient clipped far below eps barely moves
    assert _moved(max_grad_norm=1e-12) < 1e-3 * _moved(max_grad_norm=0.0)


def test_weight_decay_changes_the_update():
    assert _moved(weight_decay=0.5) != _moved(weight_decay=0.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_dtype_is_the_dtype_of_the_exported_weights(tmp_path, dtype):
    from safetensors import safe_open

    model = tiny_qwen3()
    folder = export_hf(model.state_dict(), model.model_args, tmp_path / "hf", dtype=dtype)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes == {getattr(torch, dtype)}
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == dtype


def test_cpu_threads_split_the_cores_over_every_process_unless_set(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert ParallelismConfig(cpu_threads_per_proc=3).threads(2) == 3
    assert ParallelismConfig().threads(3) == 2  # 2 trainers + 1 generator: 6 of 8 cores
    assert ParallelismConfig().threads(1) == 8
    assert ParallelismConfig().threads(16) == 1  # never fewer than one


@pytest.mark.parametrize("staleness", [0, 1])
def test_threads_never_outnumber_the_cores_even_while_roles_take_turns(monkeypatch, staleness):
    """On a busy 2-core machine a generator with a thread per core ran the default job at
    45-65 s/step against 3.4 s/step with one thread: every process gets cores // processes,
    synchronous steps too."""
    from torchtitan_rl.config import load_config
    from torchtitan_rl.controller.launcher import _threads

    for cores, replicas, expected in ((2, 1, 1), (8, 1, 2), (8, 2, 2), (16, 1, 5)):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, n=cores: set(range(n)))
        config = load_config(
            None, [f"--rollout.max_staleness={staleness}", f"--generator.num_replicas={replicas}",
                   "--parallelism.trainer_procs=2"],
        )  # fmt: skip
        assert _threads(config) == expected
        assert _threads(config) * (2 + replicas) <= max(cores, 2 + replicas)  # 1 at least


def test_decode_attention_picks_the_kernel_and_refuses_triton_on_cpu():
    engine = Engine(tiny_qwen3(), EngineConfig(max_seq_len=64, decode_attention="auto"))
    assert engine.runner.decode_attention == "gather"
    with pytest.raises(ValueError, match="triton"):
        Engine(tiny_qwen3(), EngineConfig(max_seq_len=64, decode_attention="triton"))


def test_lr_scales_the_first_update():
    # Adam's first step moves each weight by about lr (times the sign of its gradient)
    assert _moved(lr=1e-3) == pytest.approx(_moved(lr=1e-2) / 10, rel=0.05)


def test_clip_low_decides_which_negative_advantage_ratios_are_clipped():
    from torchtitan_rl.losses.policy_loss import LossConfig, policy_loss
    from torchtitan_rl.reductions import results

    lp = torch.log(torch.tensor([0.7, 0.9]))  # ratio 0.7 and 0.9 against pi_old = 1
    old, adv, seq = torch.zeros(2), -torch.ones(2), torch.tensor([0, 1])
    fracs = []
    for clip_low in (0.2, 0.4):
        _, metrics = policy_loss(
            lp, old, adv, seq, config=LossConfig(clip_low=clip_low),
            num_global_tokens=2, num_global_sequences=2,
        )  # fmt: skip
        fracs.append(results(metrics)["loss/clip_frac"])
    assert fracs == [0.5, 0.0]


def test_max_num_seqs_bounds_the_running_batch():
    import asyncio

    from torchtitan_rl.types import SamplingParams

    engine = Engine(tiny_qwen3(), EngineConfig(max_seq_len=48, max_num_seqs=2))

    async def go():
        prompts = [np.arange(4 + i, dtype=np.int32) for i in range(5)]
        sampling = SamplingParams(temperature=0.0, max_tokens=6)
        done = await asyncio.gather(
            *(
                engine.generate(p, request_id=str(i), sampling=sampling)
                for i, p in enumerate(prompts)
            )
        )
        await engine.close()
        return [c.metrics["generator/inflight_at_completion"] for c in done]

    inflight = asyncio.run(go())
    assert max(inflight) == 2


def test_alphabet_sort_args_shape_the_samples():
    from torchtitan_rl.envs.alphabet_sort import AlphabetSort, AlphabetSortConfig
    from torchtitan_rl.envs.base import EnvConfig

    args = AlphabetSortConfig(min_names=3, max_names=3, sort_by="first")
    env = AlphabetSort(EnvConfig(max_turns=2), 0, args)
    samples = [env.train_sample(i) for i in range(20)]
    assert {s["sort_by"] for s in samples} == {"first"}
    assert {len(names) for s in samples for names in s["names_per_turn"]} == {3}


def test_rollout_max_tokens_reaches_every_request():
    import asyncio

    from fakes import FakeEnvironment, FakeRenderer, ScriptedEnv, always, done

    from torchtitan_rl.rollout.rollout_config import RolloutConfig
    from torchtitan_rl.rollout.rollouter import Rollouter

    generate = always("ok")
    env_config = EnvConfig(max_rollout_tokens=1000)
    rollouter = Rollouter(
        FakeEnvironment(lambda s: ScriptedEnv([done()]), lambda r: 1.0, config=env_config),
        FakeRenderer(), env_config, RolloutConfig(max_tokens=17, group_size=2), seed=0,
    )  # fmt: skip
    asyncio.run(rollouter.collect_batch(1, 0, generate))
    assert {call.sampling.max_tokens for call in generate.calls} == {17}


def test_rollout_stop_reaches_every_training_request_as_token_ids():
    import asyncio

    from fakes import FakeEnvironment, FakeRenderer, ScriptedEnv, always, done, encode

    from torchtitan_rl.rollout.rollout_config import RolloutConfig
    from torchtitan_rl.rollout.rollouter import Rollouter

    generate = always("ok")
    env_config = EnvConfig(max_rollout_tokens=1000)
    rollouter = Rollouter(
        FakeEnvironment(lambda s: ScriptedEnv([done()]), lambda r: 1.0, config=env_config),
        FakeRenderer(), env_config, RolloutConfig(stop=["</a>", "!"], group_size=2), seed=0,
    )  # fmt: skip
    asyncio.run(rollouter.collect_batch(1, 0, generate))
    want = (tuple(encode("</a>")), tuple(encode("!")))
    assert {call.sampling.stop_sequences for call in generate.calls} == {want}


# ---- controller-level keys: a Controller with stand-ins for its actors ------------------

TINY_JOB = Path(__file__).resolve().parents[1] / "train_configs" / "alphabet_sort_tiny.toml"


def _controller(tmp_path, *overrides):
    from torchtitan_rl.config import load_config
    from torchtitan_rl.controller.loop import Controller

    config = load_config(TINY_JOB, [f"--job.output_dir={tmp_path}", *overrides])
    return Controller(config, use_tqdm=False)


class _Endpoint:
    """A Monarch endpoint stand-in: `call` records its arguments, answers {rank 0: fn(...)}."""

    def __init__(self, fn=lambda *args: None):
        self.fn, self.calls = fn, []

    async def call(self, *args):
        self.calls.append(args)
        return {0: self.fn(*args)}


class _Trainer:
    """The trainer mesh as the controller calls it; train_step runs `core` when given."""

    def __init__(self, core=None):
        self.sft_step = _Endpoint(lambda batches, ws: {"warm_start/loss": 0.0})
        self.end_warm_start = _Endpoint()
        self.train_step = _Endpoint(
            lambda updates, temperature: core.train_step([u[0] for u in updates], temperature)
        )


class _NoMetrics:
    def log(self, metrics, step):
        pass


class _NoSync:
    """A weight sync that moves nothing (version None: no version delivered)."""

    version = None

    async def __call__(self):
        return 0.0


_no_sync = _NoSync()


def test_model_max_seq_len_sizes_the_rope_cache_and_bounds_batcher_rows(tmp_path):
    from torchtitan_rl.models.qwen3 import ModelConfig, build_model

    model = build_model(ModelConfig(max_seq_len=48), VOCAB, torch.device("cpu"))
    assert model.rope_cache.shape[0] == 48
    with pytest.raises(ValueError, match="batcher.seq_len=256 exceeds model.max_seq_len=128"):
        _controller(tmp_path, "--model.max_seq_len=128", "--warm_start.steps=0")


@pytest.mark.parametrize("minibatches", [1, 2])
def test_minibatches_is_the_number_of_optimizer_steps_per_rl_step(tmp_path, minibatches):
    import asyncio

    from fakes import always

    from torchtitan_rl.losses.corrections import CorrectionConfig
    from torchtitan_rl.losses.policy_loss import LossConfig
    from torchtitan_rl.training.trainer import TrainerCore

    controller = _controller(
        tmp_path, f"--training.minibatches={minibatches}", "--warm_start.steps=0",
        "--rollout.prompts_per_step=4", "--rollout.group_size=2",
        "--rollout.filter_zero_std_groups=false",
    )  # fmt: skip
    cfg = controller.config
    core = TrainerCore(
        model_config=cfg.model, training=cfg.training, loss=LossConfig(),
        correction=CorrectionConfig(), vocab_size=controller.tokenizer.vocab_size,
        device=torch.device("cpu"), seed=0,
    )  # fmt: skip
    controller.trainer = _Trainer(core)
    batch = asyncio.run(controller.rollouter.collect_batch(1, 0, always("Ann Lee")))
    assert len(batch.groups) == 4
    asyncio.run(controller.stage.train(controller.trainer, batch.groups))
    ((updates, _),) = controller.trainer.train_step.calls
    assert len(updates) == minibatches
    assert core.policy_version == minibatches


def test_warm_start_batch_size_is_the_demonstrations_per_step(tmp_path):
    import asyncio

    controller = _controller(tmp_path, "--warm_start.steps=2", "--warm_start.batch_size=3")
    controller.trainer, controller.metrics = _Trainer(), _NoMetrics()
    controller.fleet.weight_sync = _no_sync
    packed, pack = [], controller.stage.pack

    def counting_pack(episodes):
        packed.append(len(episodes))
        return pack(episodes)

    controller.stage.pack = counting_pack
    asyncio.run(controller.warm_start())
    assert packed == [3, 3]
    sequences = [b[0][0].num_global_sequences for b, _ in controller.trainer.sft_step.calls]
    assert sequences == [3, 3]


def test_warm_start_lr_scales_the_first_supervised_update():
    from torchtitan_rl.training.trainer_config import WarmStartConfig

    def moved(lr):
        core = _core()
        before = {k: v.clone() for k, v in core.full_state_dict().items()}
        core.sft_step(_batch(), core.begin_warm_start(WarmStartConfig(lr=lr)))
        after = core.full_state_dict()
        return sum(float((after[k] - before[k]).norm() ** 2) for k in before) ** 0.5

    assert moved(1e-4) == pytest.approx(moved(1e-3) / 10, rel=0.05)


def test_validation_num_samples_and_max_tokens_shape_the_greedy_requests(tmp_path):
    import asyncio

    from fakes import always

    controller = _controller(
        tmp_path, "--warm_start.steps=0", "--validation.num_samples=5",
        "--validation.max_tokens=7",
    )  # fmt: skip
    controller.fleet.generate_fn, controller.metrics = always("Ann"), _NoMetrics()
    asyncio.run(controller.validate(0))
    calls = controller.fleet.generate_fn.calls
    assert len(calls) == 5
    assert {c.sampling.max_tokens for c in calls} == {7}
    assert {c.sampling.temperature for c in calls} == {0.0}
    assert {c.sampling.stop_sequences for c in calls} == {()}


def test_rollout_batch_timeout_s_bounds_a_validation_too(tmp_path):
    """A generator call that never returns ends the validation after
    rollout.batch_timeout_s with one line saying what the generators were doing."""
    import asyncio

    from torchtitan_rl.controller.ahead import BatchTimeout

    controller = _controller(
        tmp_path, "--warm_start.steps=0", "--validation.num_samples=3",
        "--rollout.batch_timeout_s=0.2",
    )  # fmt: skip
    pending = []

    async def never(prompt_ids, request_id, session_id, sampling):
        pending.append(request_id)
        await asyncio.Event().wait()

    async def activity():
        return f"generator: {len(pending)} calls in flight"

    controller.fleet.generate_fn, controller.metrics = never, _NoMetrics()
    controller.fleet.activity = activity
    with pytest.raises(BatchTimeout) as timeout:
        asyncio.run(asyncio.wait_for(controller.validate(4), 20))  # unbounded: TimeoutError
    assert str(timeout.value) == (
        "validation after RL step 4 unfinished after 0.2 s (rollout.batch_timeout_s): "
        "generator: 3 calls in flight"
    )


def test_a_validation_cancelled_from_outside_cancels_its_rollouts(tmp_path):
    """The run is cancelled mid-validation (a death the Supervisor ends it on, Ctrl-C,
    SIGTERM): its rollouts are cancelled with it, not left calling the generators while
    the controller closes them."""
    import asyncio

    controller = _controller(
        tmp_path, "--warm_start.steps=0", "--validation.num_samples=3",
        "--rollout.batch_timeout_s=3600",
    )  # fmt: skip
    pending, cancelled = [], []

    async def never(prompt_ids, request_id, session_id, sampling):
        pending.append(request_id)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(request_id)
            raise

    controller.fleet.generate_fn, controller.metrics = never, _NoMetrics()

    async def scenario():
        validation = asyncio.ensure_future(controller.validate(4))
        while len(pending) < 3:
            await asyncio.sleep(0.01)
        validation.cancel()
        with pytest.raises(asyncio.CancelledError):
            await validation
        for _ in range(3):  # the rollouts' cancellations run
            await asyncio.sleep(0)
        assert sorted(cancelled) == sorted(pending)  # here: asyncio.run's end cancels all

    asyncio.run(scenario())
    assert len(pending) == 3


def test_rollout_stop_ends_the_greedy_validation_turns_too(tmp_path):
    import asyncio

    from fakes import always

    controller = _controller(tmp_path, "--warm_start.steps=0", '--rollout.stop=["</answer>"]')
    controller.fleet.generate_fn, controller.metrics = always("Ann"), _NoMetrics()
    asyncio.run(controller.validate(0))
    want = (controller.renderer.stop_sequence("</answer>"),)
    assert len(want[0]) > 1 and {
        c.sampling.stop_sequences for c in controller.fleet.generate_fn.calls
    } == {want}


@pytest.mark.parametrize("keep", [1, 3])
def test_checkpoint_keep_latest_is_how_many_checkpoints_survive(tmp_path, keep):
    from torchtitan_rl.controller.checkpoints import ControllerState

    store = _controller(tmp_path, f"--checkpoint.keep_latest={keep}").folder.store
    for step in range(1, 6):
        tmp = store.begin(step)
        state = ControllerState.capture(step=step, next_sample=0, last_validation=0.0, history={})
        store.commit(tmp, step, state, "")
    assert [s for s, _ in store.complete()] == list(range(6 - keep, 6))
    assert len(list(store.root.iterdir())) == keep


@pytest.mark.parametrize(("flavor", "layers", "dim"), [("tiny", 4, 128), ("small", 6, 192)])
def test_model_flavor_picks_the_model_shape(flavor, layers, dim):
    from torchtitan_rl.models.qwen3 import ModelConfig, build_model

    model = build_model(ModelConfig(flavor=flavor, max_seq_len=64), VOCAB, torch.device("cpu"))
    assert len(model.layers) == layers
    assert model.tok_embeddings.weight.shape == (VOCAB, dim)


def test_training_dtype_sets_the_trainer_compute_precision():
    import torch.distributed as dist

    logprobs = {}
    for dtype in ("float32", "bfloat16"):
        # the trainer always runs under a process group: one rank gets FSDP's precision policy
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            logprobs[dtype] = _core(dtype=dtype).logprobs(_batch()[0])
        finally:
            dist.destroy_process_group()
    diff = np.abs(logprobs["bfloat16"] - logprobs["float32"])
    assert diff.max() > 1e-3  # bf16 keeps 8 bits of mantissa
    assert diff.max() < 0.2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_cuda_graphs_captures_the_decode_step(cuda_graphs):
    import asyncio

    from torchtitan_rl.types import SamplingParams

    config = EngineConfig(max_seq_len=64, max_num_seqs=4, cuda_graphs=cuda_graphs)
    engine = Engine(tiny_qwen3(), config, device="cuda")
    assert (engine.runner.decode_graphs is not None) == cuda_graphs

    async def go():
        sampling = SamplingParams(temperature=0.0, max_tokens=8)
        done = await engine.generate(
            np.arange(5, dtype=np.int32), request_id="0", sampling=sampling
        )
        await engine.close()
        return done

    assert asyncio.run(go()).num_tokens == 8


@pytest.mark.parametrize("compile", [False, True])
def test_training_compile_wraps_every_block_forward(compile):
    core = _core(compile=compile)
    compiled = ["_torchdynamo_orig_callable" in dir(b.forward) for b in core.model.layers.values()]
    assert compiled == [compile] * len(core.model.layers)


@pytest.mark.gpu
@pytest.mark.parametrize("key", ["training.gpu_memory_gib", "generator.gpu_memory_gib"])
def test_gpu_memory_gib_makes_an_allocation_past_it_fail(key):
    """The cap each actor sets at start (actors/trainer.py, actors/generator.py): past it
    torch's allocator raises out of memory, below it allocations succeed; a cap larger
    than the GPU is refused naming the key."""
    from torchtitan_rl.device import cap_gpu_memory

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved(device)
    try:
        cap_gpu_memory(device, held / 2**30 + 1.0, key)  # 1 GiB on top of what is held
        kept = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)  # 0.5 GiB fits
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2**30, dtype=torch.uint8, device=device)  # 0.5 + 1 GiB does not
        del kept
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        with pytest.raises(ValueError, match=f"{key}=.* GiB is more than GPU"):
            cap_gpu_memory(device, total + 1, key)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
