"""The warm start with [lora] on (`warm_start.params`): "all" trains every weight, exactly as
full training's warm start does, and RL then trains fresh adapters on that base; "adapters"
trains the adapters alone; "auto" picks "all" for a random init. A checkpoint taken after a
warm start that trained the base holds that base (once) and a resumed trainer continues
exactly; generators get the warm-started base before any adapters."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from fakes import TRAINER_VOCAB
from test_lora import lora_core, one_rank  # noqa: F401 (a fixture)
from test_lora_sync import _assert_holds_full_sync, _generator
from test_trainer import _batch, _episodes
from test_weight_sync_members import _Mesh

from torchtitan_rl.actors.trainer import TrainerActor
from torchtitan_rl.config.loader import ConfigError, load_config
from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.models.lora import LoRAConfig, is_adapter, lora_modules
from torchtitan_rl.models.qwen3 import ModelConfig
from torchtitan_rl.training.checkpoint import load_trainer_state, save_trainer_state
from torchtitan_rl.training.trainer import TrainerCore
from torchtitan_rl.training.trainer_config import TrainingConfig, WarmStartConfig
from torchtitan_rl.weight_sync.lora_sync import Payload
from torchtitan_rl.weight_sync.sides import SendingSide
from torchtitan_rl.weight_sync.transport import WeightSync

TINY_TOML = "train_configs/alphabet_sort_tiny.toml"
WARM = WarmStartConfig(lr=1e-2)  # params "auto": "all" for this random-init model


def _full_core(**loss) -> TrainerCore:
    """lora_core's policy without [lora]: what full training warm-starts."""
    return TrainerCore(
        model_config=ModelConfig(max_seq_len=64), training=TrainingConfig(lr=1e-2),
        loss=LossConfig(**loss), correction=CorrectionConfig(), vocab_size=TRAINER_VOCAB,
        device=torch.device("cpu"), seed=0,
    )  # fmt: skip


def _warm_start(core: TrainerCore, ws: WarmStartConfig = WARM, steps: int = 3) -> list[float]:
    optimizer = core.begin_warm_start(ws)
    rng = np.random.default_rng(10)
    return [
        core.sft_step(_batch(_episodes(rng)), optimizer)["warm_start/loss"] for _ in range(steps)
    ]


def _rl(core: TrainerCore, steps: range) -> list[dict]:
    out = []
    for step in steps:
        metrics = core.train_step([_batch(_episodes(np.random.default_rng(step)))], 1.0)
        out.append({k: v for k, v in metrics.items() if not k.startswith("perf/")})
    return out


def _state(core: TrainerCore) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in core.full_state_dict(merged=False).items()}


def test_auto_trains_all_of_a_random_init_and_the_adapters_of_a_hf_checkpoint():
    auto, every, adapters = (WarmStartConfig(params=p) for p in ("auto", "all", "adapters"))
    assert auto.trains_all(lora=True, hf_checkpoint="")
    assert not auto.trains_all(lora=True, hf_checkpoint="Qwen3-0.6B")
    assert every.trains_all(lora=True, hf_checkpoint="Qwen3-0.6B")
    assert not adapters.trains_all(lora=True, hf_checkpoint="")
    assert all(ws.trains_all(lora=False, hf_checkpoint="") for ws in (auto, every))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--warm_start.params=adapters"], 'warm_start.params = "adapters" trains LoRA adapters'),
        (["--warm_start.params=base"], "warm_start.params must be one of 'auto', 'all', 'adapt"),
    ],
)
def test_warm_start_params_mistakes_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY_TOML, overrides)
    assert load_config(TINY_TOML, ["--lora.rank=8", "--warm_start.params=adapters"])


@pytest.mark.usefixtures("one_rank")  # FSDP on one rank, as every trainer process runs it
def test_params_all_is_full_trainings_warm_start_then_rl_trains_adapters_on_its_base():
    full, core = _full_core(), lora_core()
    initial = _state(core)
    assert _warm_start(core) == _warm_start(full)  # the same steps, bit for bit
    assert core.training_base and not list(lora_modules(core.model))
    assert core.start_rl() is True
    assert core.base_warm_started and '"warm_started": true' in core.base
    trained, state = full.full_state_dict(), _state(core)
    base = {k for k in state if not is_adapter(k)}
    assert base == set(trained)
    assert all(torch.equal(state[k], trained[k]) for k in base)  # fp32: the same weights
    assert all(not torch.equal(state[k], initial[k]) for k in base)  # every one trained
    for k in (k for k in state if k.endswith(".lora_A")):  # the adapters start as drawn
        assert torch.equal(state[k], initial[k])
    assert all(not state[k].any() for k in state if k.endswith(".lora_B"))
    assert {n for n, p in core.model.named_parameters() if p.requires_grad} == set(state) - base

    _rl(core, range(2))
    after = _state(core)
    moved = {k for k in after if not torch.equal(after[k], state[k])}
    assert moved and all(is_adapter(k) for k in moved)  # RL trains the adapters only


def test_params_adapters_trains_the_adapters_and_leaves_the_base_as_loaded():
    core = lora_core()
    before = _state(core)
    _warm_start(core, WarmStartConfig(lr=1e-2, params="adapters"))
    assert core.start_rl() is False and not core.base_warm_started
    after = _state(core)
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert moved and all(is_adapter(k) for k in moved)


@pytest.mark.parametrize(
    "loss", [{}, {"kl_coef": 0.5}, {"kl_coef": 0.5, "kl_reference": "base"}],
    ids=["no_kl", "kl_to_rl_start", "kl_to_base"],
)  # fmt: skip
@pytest.mark.usefixtures("one_rank")
def test_a_checkpoint_after_the_warm_start_holds_the_base_once_and_resumes_exactly(tmp_path, loss):
    """The resumed trainer is built from the config alone (a random base, no warm start):
    its base, and the KL reference's, must come from the checkpoint."""
    straight = lora_core(loss=LossConfig(**loss))
    _warm_start(straight)
    straight.start_rl()
    out_straight = _rl(straight, range(4))

    first = lora_core(loss=LossConfig(**loss))
    _warm_start(first)
    first.start_rl()
    _rl(first, range(2))
    save_trainer_state(first, tmp_path / "trainer")
    keys = set(dcp.FileSystemReader(str(tmp_path / "trainer")).read_metadata().state_dict_metadata)
    assert "model.tok_embeddings.weight" in keys and "model.layers.0.attention.wq.weight" in keys
    assert not any(k.startswith("reference.") and not is_adapter(k) for k in keys)

    resumed = lora_core(loss=LossConfig(**loss))
    assert load_trainer_state(resumed, tmp_path / "trainer") == first.policy_version
    assert resumed.base_warm_started and resumed.base == first.base
    assert _rl(resumed, range(2, 4)) == out_straight[2:]
    a, b = straight.full_state_dict(merged=False), resumed.full_state_dict(merged=False)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if loss.get("kl_coef"):
        assert out_straight[-1]["loss/kl"] > 0


def test_a_warm_started_base_is_refused_by_a_run_with_another_base(tmp_path):
    core = lora_core()
    _warm_start(core)
    core.start_rl()
    save_trainer_state(core, tmp_path / "trainer")
    with pytest.raises(ValueError, match="the checkpoint's LoRA adapters belong to base"):
        load_trainer_state(lora_core(seed=1), tmp_path / "trainer")


def _call(actor, name: str, *args):
    return asyncio.run(TrainerActor.__dict__[name]._method(actor, *args))


def test_generators_get_the_warm_started_base_before_any_adapters():
    """Base sent at start, the warm start trains it: the sync opened before refuses to send
    adapters for the old base, and the one opened after sends the new base first; the
    engine then holds exactly what a full merged sync of the trainer would give it."""
    trainer = TrainerActor.__new__(TrainerActor)
    trainer.rank, trainer.core, trainer.sft_optimizer = 0, lora_core(), None
    trainer.sync_side = SendingSide(trainer.core.device)
    gen, mesh = _generator(), _Mesh(trainer)

    async def sync_at_start():
        sync = await WeightSync.create(mesh, [_Mesh(gen)], "float32", "controller")
        await sync()
        return sync

    before = asyncio.run(sync_at_start())
    first_base = trainer.sync_side.base_id
    assert gen.sync_side.held_base == first_base
    rng = np.random.default_rng(0)
    for _ in range(2):
        _call(trainer, "sft_step", [_batch(_episodes(rng))], WARM)
    assert _call(trainer, "end_warm_start") is True
    assert trainer.sync_side.base_id != first_base

    async def sync_after_warm_start():
        with pytest.raises(RuntimeError, match="reopen the sync so generators get the new base"):
            await before()
        await before.close()
        after = await WeightSync.create(mesh, [_Mesh(gen)], "float32", "controller")
        assert (after.payload, after.base_sent_to) == (Payload.ADAPTERS, 1)
        await after()
        await after.close()

    asyncio.run(sync_after_warm_start())
    assert gen.sync_side.held_base == trainer.sync_side.base_id
    _assert_holds_full_sync(gen, trainer, "float32")


@pytest.fixture
def one_gpu_rank():
    """A one-rank NCCL group: FSDP with bf16 mixed precision on the GPU."""
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_bf16_the_all_warm_start_keeps_fp32_master_weights_then_freezes_a_bf16_base(
    one_gpu_rank,
):
    """bf16 on a GPU: the warm start is full training's (fp32 master weights, bf16 compute),
    not bf16 weights updated in place; RL then trains fp32 adapters on that base rounded
    to bf16 once."""

    def core(lora: bool) -> TrainerCore:
        return TrainerCore(
            model_config=ModelConfig(max_seq_len=64),
            training=TrainingConfig(lr=1e-2, dtype="bfloat16"), loss=LossConfig(),
            correction=CorrectionConfig(), vocab_size=TRAINER_VOCAB,
            device=torch.device("cuda"), seed=0, lora=LoRAConfig(rank=4) if lora else None,
        )  # fmt: skip

    full, lora = core(False), core(True)
    assert _warm_start(lora) == pytest.approx(_warm_start(full), rel=1e-3)
    assert {p.dtype for p in lora.model.parameters()} == {torch.float32}  # master weights
    assert lora.start_rl()
    params = dict(lora.model.named_parameters())
    assert {p.dtype for n, p in params.items() if not is_adapter(n)} == {torch.bfloat16}
    assert {p.dtype for n, p in params.items() if is_adapter(n)} == {torch.float32}
    trained, state = full.full_state_dict(), _state(lora)
    for name, weight in trained.items():  # one rounding of the trained fp32 weights
        torch.testing.assert_close(state[name], weight.bfloat16().float(), rtol=1e-2, atol=1e-3)
    _rl(lora, range(2))
    after = _state(lora)
    moved = {k for k in after if not torch.equal(after[k], state[k])}
    assert moved and all(is_adapter(k) for k in moved)
