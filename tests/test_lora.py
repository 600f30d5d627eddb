"""LoRA on the trainer (one process): the adapter's numerics against a float64 reference,
step 0 is the base policy, only adapters train, every [lora] key has its effect, the
weights a generator receives are the merged ones, and the "base" KL reference is the base
model's log-probs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import torch.distributed as dist
from fakes import TRAINER_VOCAB
from test_trainer import _batch, _episodes

from torchtitan_rl.config.loader import ConfigError, load_config
from torchtitan_rl.generation.engine import Engine
from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.models.lora import (
    TARGETS,
    LoRAConfig,
    LoRALinear,
    adapter_weights,
    lora_modules,
)
from torchtitan_rl.models.qwen3 import ModelConfig, build_model
from torchtitan_rl.training.trainer import TrainerCore
from torchtitan_rl.training.trainer_config import TrainingConfig
from torchtitan_rl.types import SamplingParams
from torchtitan_rl.weight_sync.packing import unpack_weights

TINY_TOML = "train_configs/alphabet_sort_tiny.toml"


def lora_core(*, seed=0, loss=None, lr=1e-2, dtype="float32", **lora) -> TrainerCore:
    """The tiny policy (vocabulary TRAINER_VOCAB) with [lora] as given (rank 4 unless set)."""
    return TrainerCore(
        model_config=ModelConfig(max_seq_len=64),
        training=TrainingConfig(lr=lr, dtype=dtype),
        loss=loss or LossConfig(),
        correction=CorrectionConfig(),
        vocab_size=TRAINER_VOCAB,
        device=torch.device("cpu"),
        seed=seed,
        lora=LoRAConfig(**{"rank": 4, **lora}),
    )


@torch.no_grad()
def nonzero_b(core: TrainerCore, seed: int = 1, std: float = 0.05) -> None:
    """Give every B a random value (B starts at zero: merges would be trivially the base)."""
    g = torch.Generator().manual_seed(seed)
    for _, m in lora_modules(core.model):
        local = m.lora_B.to_local() if hasattr(m.lora_B, "to_local") else m.lora_B
        local.copy_(std * torch.randn(local.shape, generator=g))


def test_lora_linear_forward_and_gradients_equal_a_float64_reference():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5, bias=False).double()
    base.weight.requires_grad_(False)
    m = LoRALinear(base, rank=3, scale=2.5, dropout=0.0)
    with torch.no_grad():
        m.lora_A.data = torch.randn(3, 6, dtype=torch.float64)
        m.lora_B.data = torch.randn(5, 3, dtype=torch.float64)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 5, dtype=torch.float64)
    y = m(x)
    (y * g).sum().backward()
    W, A, B, s = base.weight, m.lora_A.detach(), m.lora_B.detach(), 2.5
    # by hand: y = x W^T + s x A^T B^T
    torch.testing.assert_close(y, x.detach() @ W.T + s * x.detach() @ A.T @ B.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(m.lora_B.grad, s * g.T @ (x.detach() @ A.T), rtol=0, atol=1e-12)
    torch.testing.assert_close(m.lora_A.grad, s * (g @ B).T @ x.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, g @ W + s * g @ B @ A, rtol=0, atol=1e-12)
    assert base.weight.grad is None


def test_step_zero_is_the_base_policy_and_a_step_trains_only_the_adapters():
    batch = _batch(_episodes(np.random.default_rng(0)))
    full = TrainerCore(
        model_config=ModelConfig(max_seq_len=64),
        training=TrainingConfig(lr=1e-2),
        loss=LossConfig(),
        correction=CorrectionConfig(),
        vocab_size=TRAINER_VOCAB,
        device=torch.device("cpu"),
        seed=0,
    )
    core = lora_core()
    for mb in batch:  # B = 0: the adapter adds exactly nothing
        np.testing.assert_array_equal(core.logprobs(mb), full.logprobs(mb))
    adapters = {n for n, p in core.model.named_parameters() if p.requires_grad}
    per_block = len(TARGETS) * 2
    assert len(adapters) == per_block * len(core.model.layers)
    assert all(n.endswith((".lora_A", ".lora_B")) for n in adapters)
    optimized = [p for g in core.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in optimized) == sum(
        p.numel() for n, p in core.model.named_parameters() if n in adapters
    )
    before = {k: v.clone() for k, v in core.model.state_dict().items()}
    core.train_step([batch], 1.0)
    after = core.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and moved <= adapters  # B moves (A's gradient is 0 while B is 0)
    state = core.optimizer.state
    assert len(state) == len(optimized)  # Adam moments of adapters only
    assert sum(s["exp_avg"].numel() for s in state.values()) < 0.1 * sum(
        p.numel() for p in core.model.parameters()
    )


def test_the_frozen_base_is_kept_in_the_training_dtype():
    core = lora_core(dtype="bfloat16")
    params = dict(core.model.named_parameters())
    assert {p.dtype for n, p in params.items() if "lora_" not in n} == {torch.bfloat16}
    assert {p.dtype for n, p in params.items() if "lora_" in n} == {torch.float32}


@pytest.mark.parametrize(
    "override, message",
    [
        ("--lora.rank=-1", "lora.rank must be >= 0"),
        ("--lora.alpha=0.0", "lora.alpha must be finite and > 0"),
        ("--lora.dropout=1.0", "lora.dropout must be in [0, 1)"),
        ('--lora.target_modules=["q_proj", "qkv"]', "lora.target_modules must be"),
        ("--loss.kl_reference=base", 'loss.kl_reference = "base"'),
    ],
)
def test_lora_mistakes_are_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY_TOML, ["--loss.kl_coef=0.1", override])
    assert message in str(e.value) and "\n" not in str(e.value)
    if "target_modules" in override:
        assert "gate_proj" in str(e.value) and "'qkv'" in str(e.value)


def test_lora_rank_turns_the_adapters_on_and_target_modules_picks_them():
    assert load_config(TINY_TOML, []).lora.rank == 0
    config = load_config(
        TINY_TOML, ["--lora.rank=8", '--lora.target_modules=["q_proj","down_proj"]']
    )
    assert config.lora.rank == 8 and config.lora.scale == 1.0  # PEFT's default alpha 8
    core = lora_core(rank=config.lora.rank, target_modules=config.lora.target_modules)
    names = {n.split(".", 2)[2] for n, _ in lora_modules(core.model)}
    assert names == {"attention.wq", "feed_forward.w2"}
    m = core.model.layers["0"].feed_forward.w2
    assert m.lora_A.shape == (8, m.in_features) and m.lora_B.shape == (m.out_features, 8)
    assert not list(lora_modules(lora_core(rank=0).model))


@pytest.mark.parametrize("alpha", [4.0, 16.0])
def test_alpha_over_rank_scales_the_merged_update(alpha):
    core = lora_core(alpha=alpha)
    nonzero_b(core)
    merged = core.full_state_dict()
    own = core.model.state_dict()
    for name, m in lora_modules(core.model):
        expect = own[f"{name}.weight"].double() + alpha / 4 * (
            m.lora_B.detach().double() @ m.lora_A.detach().double()
        )
        torch.testing.assert_close(merged[f"{name}.weight"].double(), expect, rtol=0, atol=1e-6)
    assert not any("lora_" in k for k in merged)


def test_dropout_drops_adapter_inputs_only_while_training():
    batch = _batch(_episodes(np.random.default_rng(1)))
    t = None
    outs = {}
    for dropout in (0.0, 0.5):
        core = lora_core(dropout=dropout)
        nonzero_b(core, std=0.5)
        t = core._tensors(batch[0])
        core.model.train()
        with torch.no_grad():
            outs[dropout] = [core._logprobs(t, 1.0)[0] for _ in range(2)]
        core.model.eval()
        with torch.no_grad():
            outs[dropout, "eval"] = core._logprobs(t, 1.0)[0]
    assert torch.equal(outs[0.0][0], outs[0.0][1])
    assert not torch.equal(outs[0.5][0], outs[0.5][1])
    assert torch.equal(outs[0.5, "eval"], outs[0.0, "eval"])


@pytest.fixture
def one_rank():
    """A one-rank gloo group, so TrainerCore shards its model with FSDP (DTensors)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _publish(core: TrainerCore, dtype: str = "float32"):
    from torchtitan_rl.actors.trainer import TrainerActor

    actor = TrainerActor.__new__(TrainerActor)
    actor.rank, actor.core = 0, core
    return asyncio.run(TrainerActor.__dict__["publish_weights"]._method(actor, dtype))


def test_published_weights_are_the_merged_weights_and_the_generator_agrees(one_rank):
    """Under FSDP: the packed weights equal W + scale * B @ A (float64), under the
    generator's names, and an engine loaded with them gives the trainer's log-probs."""
    core = lora_core(alpha=6.0)
    nonzero_b(core)
    packed = _publish(core)
    back = unpack_weights(packed)
    base = build_model(ModelConfig(max_seq_len=64), TRAINER_VOCAB, torch.device("cpu"))
    assert list(back) == list(base.state_dict())
    adapters = adapter_weights(core.model, core.lora, 0)
    torch.manual_seed(0)
    base = build_model(ModelConfig(max_seq_len=64), TRAINER_VOCAB, torch.device("cpu"))
    for name, w in base.state_dict().items():
        hf = _hf_name(name)
        expect = w.double()
        if hf in adapters.tensors:
            a, b = adapters.tensors[hf]
            expect = expect + 1.5 * b.double() @ a.double()
        torch.testing.assert_close(back[name].double(), expect, rtol=0, atol=2e-7)

    torch.manual_seed(1)  # another init: everything must come from the sync
    model = build_model(ModelConfig(max_seq_len=64), TRAINER_VOCAB, torch.device("cpu"))
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_seq_len=64), "cpu")
    engine.load_weights(back, packed.version)
    prompt = np.arange(5, dtype=np.int32)
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=3)

    async def generate():
        out = await engine.generate(prompt, request_id="r", sampling=sampling)
        await engine.close()
        return out

    out = asyncio.run(generate())
    tokens = np.concatenate([prompt, out.token_ids_N])
    t = _one_row(tokens, len(prompt))
    with torch.no_grad():
        trainer_N = core._logprobs(t, 1.0)[0]
    np.testing.assert_allclose(out.logprobs_N, trainer_N.numpy(), atol=1e-5)


def _hf_name(name: str) -> str | None:
    from torchtitan_rl.models.lora import hf_module_name

    prefix = name.removesuffix(".weight")
    try:
        return hf_module_name(prefix)
    except (StopIteration, ValueError):
        return None


def _one_row(tokens: np.ndarray, start: int) -> dict:
    """Trainer inputs for one sequence, log-probs of tokens[start:]."""
    t = torch.from_numpy(tokens).long()[None]
    n = t.shape[1]
    return {
        "tokens_BS": t,
        "positions_BS": torch.arange(n)[None],
        "document_ids_BS": torch.zeros(1, n, dtype=torch.long),
        "loss_index_N": torch.arange(start - 1, n - 1),
        "targets_N": t[0, start:],
    }


def test_base_kl_reference_is_the_base_model_with_adapters_disabled():
    loss = LossConfig(kl_coef=0.5, kl_reference="base")
    core = lora_core(loss=loss)
    assert core.reference is None  # no second model
    nonzero_b(core, std=0.5)
    batch = _batch(_episodes(np.random.default_rng(2)))
    t = core._tensors(batch[0])
    ref_N = core._reference_logprobs(t, 1.0)
    torch.manual_seed(0)
    base = build_model(ModelConfig(max_seq_len=64), TRAINER_VOCAB, torch.device("cpu")).double()
    with torch.no_grad():
        base_N, _ = base(*[t[k] for k in ("tokens_BS", "positions_BS", "document_ids_BS")],
                         t["loss_index_N"], t["targets_N"])  # fmt: skip
    torch.testing.assert_close(ref_N.double(), base_N, rtol=0, atol=1e-5)
    with torch.no_grad():
        policy_N = core._logprobs(t, 1.0)[0]
    assert (policy_N - ref_N).abs().max() > 1e-2  # the adapters are back on after it
    out = core.train_step([batch], 1.0)
    assert out["loss/kl"] > 0


def test_pi_old_is_recomputed_without_dropout():
    """pi_old is the policy the generator sampled from (merged weights, no dropout): two
    recomputes agree, and equal the eval-mode log-probs, with lora.dropout > 0."""
    batch = _batch(_episodes(np.random.default_rng(1)))
    core = lora_core(dropout=0.5)
    nonzero_b(core, std=0.5)
    tensors = [[core._tensors(batch[0])]]
    core.model.train()
    first = core._old_logprobs(tensors, 1.0)[0][0]
    again = core._old_logprobs(tensors, 1.0)[0][0]
    core.model.eval()
    with torch.no_grad():
        eval_mode = core._logprobs(tensors[0][0], 1.0)[0]
    assert torch.equal(first, again) and torch.equal(first, eval_mode)


def test_the_base_record_names_what_the_random_base_depends_on():
    from torchtitan_rl.models.lora import base_record

    model, lora = ModelConfig(), LoRAConfig(rank=4)
    record = dict(vocab_size=96, dtype="float32", device="cpu")
    one = base_record(model, 0, lora, **record)
    assert one == base_record(model, 0, lora, **record)
    for key, other in (("vocab_size", 160), ("dtype", "bfloat16"), ("device", "cuda")):
        assert base_record(model, 0, lora, **{**record, key: other}) != one, key
