"""The LoRA export: the trainer actor's `export_hf` writes the merged Hugging Face folder and a
PEFT adapter folder next to it; transformers loads the merged folder, transformers + peft load
the base with the adapter, and both give the trainer's log-probs (float32)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from test_lora import nonzero_b

from torchtitan_rl.losses.corrections import CorrectionConfig
from torchtitan_rl.losses.policy_loss import LossConfig
from torchtitan_rl.models.lora import LoRAConfig
from torchtitan_rl.models.qwen3 import ModelConfig
from torchtitan_rl.models.tokenizer import Tokenizer
from torchtitan_rl.training.trainer import TrainerCore
from torchtitan_rl.training.trainer_config import TrainingConfig

SEQ = 24


def _export(core: TrainerCore, folder, hf_checkpoint: str = "") -> None:
    """The trainer actor's `export_hf` endpoint, run on a bare actor (no Monarch)."""
    from torchtitan_rl.actors.trainer import TrainerActor

    actor = TrainerActor.__new__(TrainerActor)
    actor.rank, actor.core = 0, core
    export = TrainerActor.__dict__["export_hf"]._method
    asyncio.run(export(actor, str(folder), hf_checkpoint, "float32"))


def _hf_logprobs(model, tokens_BS) -> np.ndarray:
    with torch.no_grad():
        logits_BSV = model(input_ids=tokens_BS).logits
    logprobs = torch.log_softmax(logits_BSV[:, :-1].double(), -1)
    return logprobs.gather(2, tokens_BS[:, 1:, None])[..., 0].flatten().numpy()


def _trainer_logprobs(core: TrainerCore, tokens_BS) -> np.ndarray:
    B, S = tokens_BS.shape
    index = torch.arange(B * S).view(B, S)[:, :-1].flatten()
    core.model.eval()
    with torch.no_grad():
        logprobs_N, _ = core.model(
            tokens_BS, torch.arange(S).repeat(B, 1), torch.zeros(B, S, dtype=torch.long),
            index, tokens_BS[:, 1:].flatten(),
        )  # fmt: skip
    return logprobs_N.double().numpy()


def test_peft_loads_the_adapter_onto_the_base_and_gives_the_trainers_logprobs(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    vocab = Tokenizer.from_file(None).vocab_size
    core = TrainerCore(
        model_config=ModelConfig(max_seq_len=64),
        training=TrainingConfig(),
        loss=LossConfig(),
        correction=CorrectionConfig(),
        vocab_size=vocab,
        device=torch.device("cpu"),
        seed=0,
        lora=LoRAConfig(rank=4, alpha=6.0, target_modules=["q_proj", "v_proj", "gate_proj"]),
    )
    nonzero_b(core, std=0.2)
    _export(core, tmp_path / "hf")
    adapter = tmp_path / "hf_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 6.0
    assert config["target_modules"] == ["gate_proj", "q_proj", "v_proj"]
    tokens_BS = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ours = _trainer_logprobs(core, tokens_BS)

    load = transformers.AutoModelForCausalLM.from_pretrained
    base = load(config["base_model_name_or_path"], dtype=torch.float32).eval()
    base_only = _hf_logprobs(base, tokens_BS)
    assert np.abs(base_only - ours).max() > 1e-2  # the adapters change the policy
    with_adapter = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    np.testing.assert_allclose(_hf_logprobs(with_adapter, tokens_BS), ours, atol=1e-5, rtol=0)
    merged = load(str(tmp_path / "hf"), dtype=torch.float32).eval()
    np.testing.assert_allclose(_hf_logprobs(merged, tokens_BS), ours, atol=1e-5, rtol=0)


def test_a_warm_started_base_goes_into_the_adapter_folder_even_over_a_hf_checkpoint(tmp_path):
    """`warm_start.params = "all"` trained the base loaded from model.hf_checkpoint: the
    adapter applies to that trained base, so the folder holds it (base/) and names it, and
    base + adapter give the trainer's log-probs; the original folder would not."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import numpy as np
    from test_trainer import _batch, _episodes

    from torchtitan_rl.training.trainer_config import WarmStartConfig

    vocab = Tokenizer.from_file(None).vocab_size
    start = TrainerCore(
        model_config=ModelConfig(max_seq_len=64), training=TrainingConfig(), loss=LossConfig(),
        correction=CorrectionConfig(), vocab_size=vocab, device=torch.device("cpu"), seed=0,
    )  # fmt: skip
    _export(start, tmp_path / "start")  # the Hugging Face folder the run loads
    core = TrainerCore(
        model_config=ModelConfig(max_seq_len=64, hf_checkpoint=str(tmp_path / "start")),
        training=TrainingConfig(), loss=LossConfig(), correction=CorrectionConfig(),
        vocab_size=vocab, device=torch.device("cpu"), seed=0, lora=LoRAConfig(rank=4),
    )  # fmt: skip
    optimizer = core.begin_warm_start(WarmStartConfig(lr=1e-2, params="all"))
    rng = np.random.default_rng(0)
    for _ in range(2):
        core.sft_step(_batch(_episodes(rng)), optimizer)
    assert core.start_rl()
    nonzero_b(core, std=0.2)
    _export(core, tmp_path / "hf", hf_checkpoint=str(tmp_path / "start"))
    adapter = tmp_path / "hf_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((adapter / "base").resolve())
    tokens_BS = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ours = _trainer_logprobs(core, tokens_BS)

    load = transformers.AutoModelForCausalLM.from_pretrained
    for base_folder, agrees in ((adapter / "base", True), (tmp_path / "start", False)):
        base = load(str(base_folder), dtype=torch.float32).eval()
        with_adapter = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
        gap = np.abs(_hf_logprobs(with_adapter, tokens_BS) - ours).max()
        assert (gap < 1e-5) == agrees, (base_folder, gap)
