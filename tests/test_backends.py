"""The backend table (generation/backends.py): a row per backend, and every code path that
differs between backends reads its trait there, never the backend's name. Each behaviour test
flips one trait of a row and checks that the code path follows the trait."""

import ast
import asyncio
import dataclasses
import importlib
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import get_args

import pytest
import torch

from torchtitan_rl.config import ConfigError, load_config
from torchtitan_rl.config.job import ParallelismConfig
from torchtitan_rl.controller.placement import Placement, plan
from torchtitan_rl.generation import backends
from torchtitan_rl.generation.backends import BACKENDS, Backend, traits
from torchtitan_rl.generation.interface import EngineConfig

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_rl"
TINY = PACKAGE.parent / "train_configs" / "alphabet_sort_tiny.toml"
NAMES = {"native", "vllm"}


def _set(monkeypatch, backend: str, **changes) -> None:
    """Row `backend` of the table with `changes` for this test."""
    monkeypatch.setitem(BACKENDS, backend, dataclasses.replace(BACKENDS[backend], **changes))


def test_every_backend_value_has_a_row_whose_factory_resolves():
    assert set(get_args(Backend)) == set(BACKENDS)
    for name, row in BACKENDS.items():
        module, attr = row.engine_factory.split(":")
        assert callable(getattr(importlib.import_module(module), attr)), name
    assert "vllm" not in vars(backends)  # no engine (nor vLLM) imported by the table


def _name_compares(tree: ast.AST) -> list[int]:
    """Lines comparing something with the string "vllm" or "native" (==, !=, in, is)."""

    def names(node: ast.expr) -> bool:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(i, ast.Constant) and i.value in NAMES for i in items)

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(map(names, [node.left, *node.comparators]))
    ]


def test_no_module_outside_generation_compares_a_backend_name():
    assert _name_compares(ast.parse('if b == "vllm" or "native" in bs: pass')) == [1, 1]
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in PACKAGE.rglob("*.py")
        if "generation" not in path.relative_to(PACKAGE).parts
        and (lines := _name_compares(ast.parse(path.read_text())))
    }
    assert found == {}


def test_placement_follows_any_gpu_of_host(monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    par = ParallelismConfig(trainer_procs=1, device="cuda", placement="split")
    assert plan(par, 2, "native") == Placement(trainer=(0,), generators=(1, 2), gpus=4)
    _set(monkeypatch, "native", any_gpu_of_host=False)
    with pytest.raises(ValueError) as e:
        plan(par, 2, "native")
    assert str(e.value) == (
        'parallelism.placement = "split" is not available with generator.backend = "native" '
        '(the native engine starts its engine on GPU 0); valid: "auto" or "shared"'
    )
    _set(monkeypatch, "vllm", any_gpu_of_host=True)
    assert plan(par, 2, "vllm") == Placement(trainer=(0,), generators=(1, 2), gpus=4)


def _start_folder(backend: str, tmp_path, hf_checkpoint: str = "") -> tuple[str, list]:
    """`Controller.generator_start_folder` on a config for `backend`, with a trainer that
    records its exports (instead of exporting a model)."""
    from torchtitan_rl.controller.fleet import GeneratorFleet
    from torchtitan_rl.controller.supervision import Supervisor

    exports = []

    async def export(folder, tokenizer, dtype):
        exports.append((folder, dtype))

    config = load_config(TINY, [f"--generator.backend={backend}", "--parallelism.device=cpu"])
    config.model.hf_checkpoint = hf_checkpoint  # set after loading: no folder to check
    fleet = GeneratorFleet(config, Supervisor(("trainer",)), vocab_size=64, log_dir=tmp_path)
    fleet.trainer = SimpleNamespace(export_hf=SimpleNamespace(call=export))
    return asyncio.run(fleet.start_folder(tmp_path)), exports


def test_the_start_folder_export_follows_starts_from_hf_folder(monkeypatch, tmp_path):
    assert _start_folder("native", tmp_path) == ("", [])
    _set(monkeypatch, "native", starts_from_hf_folder=True)
    folder = str(tmp_path / "generator_start_hf")
    assert _start_folder("native", tmp_path) == (folder, [(folder, "float32")])
    assert _start_folder("native", tmp_path, "/given") == ("/given", [])


def test_rollout_stop_follows_stop_texts(monkeypatch):
    args = ['--rollout.stop=["</answer>"]', "--parallelism.device=cpu"]
    assert load_config(TINY, args).rollout.stop == ["</answer>"]
    _set(monkeypatch, "native", stop_texts=False)
    with pytest.raises(ConfigError) as e:
        load_config(TINY, args)
    assert str(e.value) == (
        "rollout.stop=['</answer>'] works with the native generator only (the native backend "
        'generates token ids without text); use generator.backend = "native" or rollout.stop = []'
    )


def test_the_install_check_follows_package(monkeypatch):
    _set(monkeypatch, "native", package="no_such_package_for_tests", install_hint="see HERE")
    assert importlib.util.find_spec("no_such_package_for_tests") is None
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["--parallelism.device=cpu"])
    assert str(e.value) == (
        'generator.backend = "native" needs the native engine, which is not installed: '
        'see HERE or use generator.backend = "native"'
    )


def test_cpu_block_sizes_follow_cpu_block_multiple(monkeypatch):
    assert EngineConfig().for_device("cpu").block_size == 16
    _set(monkeypatch, "native", cpu_block_multiple=64)
    assert EngineConfig().for_device("cpu").block_size == 64
    assert EngineConfig().for_device("cuda").block_size == 16
    assert EngineConfig(block_size=8).for_device("cpu").block_size == 8  # a set value stays
    with pytest.raises(ConfigError, match="the native engine on CPU needs a multiple of 64"):
        load_config(TINY, ["--parallelism.device=cpu", "--generator.block_size=32"])
    assert load_config(TINY, ["--parallelism.device=cpu", "--generator.block_size=128"])


def test_served_adapters_on_a_gpu_follow_gpu_adapter_dtypes(monkeypatch):
    """vLLM's GPU LoRA kernels take 16-bit inputs only (float32 failed inside vLLM 0.26 on
    an H200): served adapters in float32 on a GPU are refused in one line; on CPU, merged,
    or for a backend that serves none (the native engine merges), nothing is refused."""
    served = ["--lora.rank=8", '--lora.vllm_sync="adapters"', '--generator.dtype="float32"']
    _set(monkeypatch, "native", gpu_adapter_dtypes=("bfloat16",))
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["--parallelism.device=cuda", *served])
    assert str(e.value) == (
        'lora.vllm_sync = "adapters" with generator.dtype = "float32": the native engine serves '
        'adapters on a GPU in bfloat16 only; use generator.dtype = "bfloat16" or '
        'lora.vllm_sync = "merged"'
    )
    load_config(TINY, ["--parallelism.device=cuda", *served[:2], '--generator.dtype="bfloat16"'])
    load_config(TINY, ["--parallelism.device=cpu", *served])
    load_config(TINY, ["--parallelism.device=cuda", *served[::2], '--lora.vllm_sync="merged"'])
    _set(monkeypatch, "native", gpu_adapter_dtypes=())
    load_config(TINY, ["--parallelism.device=cuda", *served])
    assert traits("vllm").gpu_adapter_dtypes == ("bfloat16",)
    # checked again where the engine starts (a launcher's config may load on a host without
    # a GPU, device "auto"), before vLLM is imported
    from torchtitan_rl.generation.vllm_engine import start_vllm_engine
    from torchtitan_rl.models.lora import LoRAConfig

    config = EngineConfig(backend="vllm", dtype="float32")
    with pytest.raises(
        ValueError,
        match='^lora.vllm_sync = "adapters" with generator.dtype = "float32": vLLM serves',
    ):
        start_vllm_engine("unused", config, torch.device("cuda"), state_dict_adapter=None,
                          lora=LoRAConfig(rank=8, vllm_sync="adapters"))  # fmt: skip


def test_decode_attention_follows_own_decode_attention(monkeypatch):
    EngineConfig(decode_attention="gather").validate()
    _set(monkeypatch, "native", own_decode_attention=False)
    with pytest.raises(ValueError, match="is native only: the native engine picks its own"):
        EngineConfig(decode_attention="gather").validate()
    EngineConfig().validate()  # "auto" stays valid


def test_batch_invariant_follows_batch_invariant_mode(monkeypatch):
    EngineConfig(batch_invariant=True).validate()
    with pytest.raises(ValueError, match="generator.batch_invariant is native only: vLLM"):
        EngineConfig(backend="vllm", batch_invariant=True).validate()
    _set(monkeypatch, "native", batch_invariant_mode=False)
    with pytest.raises(ValueError, match="generator.batch_invariant is native only"):
        EngineConfig(batch_invariant=True).validate()
    EngineConfig().validate()  # off stays valid


def _recording_factory(model, engine, vocab_size, device, hf_folder, lora):
    return ("built", engine.backend, vocab_size, device, hf_folder, lora)


def test_build_engine_follows_engine_factory(monkeypatch):
    from torchtitan_rl.actors.generator import build_engine
    from torchtitan_rl.generation.engine import Engine
    from torchtitan_rl.models.qwen3 import ModelConfig

    config = EngineConfig(max_num_seqs=2, max_seq_len=32)
    native = build_engine(ModelConfig(), config, 97, torch.device("cpu"), "")
    assert isinstance(native, Engine)
    names = {name for name, _ in native.model_parameters()}
    assert "tok_embeddings.weight" in names and "output.weight" in names
    _set(monkeypatch, "native", engine_factory=f"{__name__}:_recording_factory")
    built = build_engine(ModelConfig(), config, 97, "cpu", "/f", "lora")
    assert built == ("built", "native", 97, "cpu", "/f", "lora")
    assert traits("native").build(None, config, 5, "d", "") == (
        "built", "native", 5, "d", "", None,
    )  # fmt: skip
