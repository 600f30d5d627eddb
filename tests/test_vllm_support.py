"""Which vLLM releases the backend takes, and its fallback where a release lacks a feature.

No vLLM needed: the version check is a pure function, and `VllmEngine` is driven by fakes of
vLLM's `LLMEngine` as 0.26.0 (no `set_weight_version`, outputs without `weight_versions`) and
0.32.0 (both) have it."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from torchtitan_rl.generation.interface import EngineConfig
from torchtitan_rl.generation.vllm_engine import VllmEngine
from torchtitan_rl.generation.vllm_lora import names_in_lora_layers
from torchtitan_rl.generation.vllm_support import (
    check_vllm_version,
    detect_features,
    weight_path,
)
from torchtitan_rl.types import SamplingParams


@pytest.mark.parametrize(
    "version", ["0.26.0", "0.26.0rc1", "0.29.1", "0.32.0", "0.32.0+cpu", "0.32.5.dev3+gabc123"]
)
def test_supported_releases_pass(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.25.1", "0.33.0", "0.33.0rc1", "1.0.0", "0.9.2", "main"])
def test_unsupported_releases_are_refused_in_one_line_naming_the_range(version):
    with pytest.raises(ValueError) as err:
        check_vllm_version(version)
    message = str(err.value)
    assert version in message and "0.26.x to 0.32.x" in message
    assert "\n" not in message


class Fake026:
    """What VllmEngine calls on vLLM 0.26.0's LLMEngine. Every step gives each running request
    one token: the value of the loaded weight "w", so a token says which weights made it.
    Like vLLM, the prefix cache resets only once nothing runs (or running requests reset)."""

    def __init__(self):
        self.requests: dict[str, tuple[SimpleNamespace, list[int], list[str]]] = {}
        self.sync_side = 0
        self.label = "0"
        self.events: list[str] = []
        self.engine_core = SimpleNamespace(shutdown=lambda: self.events.append("shutdown"))

    def add_request(self, request_id, prompt, params):
        self.events.append(f"add {request_id}")
        self.requests[request_id] = (params, [], [])

    def abort_request(self, request_ids):
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        self.sync_side = int(dict(kwargs["weights_iterator"])["w"].item())

    def reset_prefix_cache(self, reset_running_requests=False):
        return reset_running_requests or not self.requests

    def step(self):
        outputs = []
        for request_id, (params, tokens, labels) in list(self.requests.items()):
            tokens.append(self.sync_side)
            labels.append(self.label)
            done = len(tokens) >= params.max_tokens
            if done:
                del self.requests[request_id]
                self.events.append(f"finish {request_id}")
            out = SimpleNamespace(
                token_ids=list(tokens),
                logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in tokens],
                finish_reason="length" if done else None,
            )
            self._label(out, labels)
            outputs.append(
                SimpleNamespace(
                    request_id=request_id, finished=done, num_cached_tokens=0, outputs=[out]
                )
            )
        return outputs

    def _label(self, out, labels):
        """0.26.0's CompletionOutput has no weight_versions."""


class Fake032(Fake026):
    """0.32.0 adds set_weight_version and per-token version spans on each output."""

    def set_weight_version(self, version: str) -> None:
        self.events.append(f"label {version}")
        self.label = version

    def _label(self, out, labels):
        out.weight_versions = [
            SimpleNamespace(version=v, start=i, end=i + 1) for i, v in enumerate(labels)
        ]


def test_features_follow_what_the_engine_object_has():
    assert not detect_features(Fake026()).weight_versions
    assert detect_features(Fake032()).weight_versions
    assert "own step bookkeeping" in detect_features(Fake026()).describe()


def test_names_in_lora_layers_reach_the_wrapped_layers_base_weights():
    """vLLM 0.26 built with LoRA, as on an H200: q/k/v fused into a wrapped qkv_proj, o_proj
    and a top-level lm_head wrapped, the norms and embeddings not. A name reaches
    `<layer>.base_layer.<param>` where the layer (or the fused layer it is part of) is
    wrapped, and stays as it is elsewhere, and wherever the wrapper loads its base layer
    itself (vLLM 0.32's `BaseLayerWithLoRA.load_weights`)."""

    class Wrapper026(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base_layer = torch.nn.Linear(2, 2, bias=False)

    class Wrapper032(Wrapper026):
        def load_weights(self, weights):
            return []

    def model_with(wrapper):
        attention = torch.nn.ModuleDict({"qkv_proj": wrapper(), "o_proj": wrapper()})
        attention["q_norm"] = torch.nn.LayerNorm(2)
        layer = torch.nn.ModuleDict({"self_attn": attention, "mlp": torch.nn.ModuleDict()})
        layer["mlp"]["down_proj"] = torch.nn.Linear(2, 2)  # a layer LoRA does not serve
        model = torch.nn.Module()
        model.model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([layer])})
        model.model["embed_tokens"] = torch.nn.Embedding(4, 2)
        model.lm_head = wrapper()
        model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
        return model

    rename = names_in_lora_layers(model_with(Wrapper026))
    a = "model.layers.0.self_attn."
    assert rename(a + "q_proj.weight") == a + "q_proj.base_layer.weight"
    assert rename(a + "v_proj.weight") == a + "v_proj.base_layer.weight"
    assert rename(a + "o_proj.weight") == a + "o_proj.base_layer.weight"
    assert rename("lm_head.weight") == "lm_head.base_layer.weight"
    unchanged = [a + "q_norm.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.embed_tokens.weight"]  # fmt: skip
    for name in unchanged:
        assert rename(name) == name
    rename = names_in_lora_layers(model_with(Wrapper032))
    for name in [*unchanged, a + "q_proj.weight", a + "o_proj.weight", "lm_head.weight"]:
        assert rename(name) == name


def test_weight_path_names_host_or_device_tensors():
    assert "host memory" in weight_path({"a": torch.zeros(2), "b": torch.zeros(1)})
    meta = weight_path({"a": torch.zeros(2, device="meta")})
    assert "on the device" in meta and "meta" in meta


def _engine(llm) -> VllmEngine:
    config = EngineConfig(backend="vllm", max_seq_len=64)
    return VllmEngine(
        llm,
        config,
        vocab_size=100,
        state_dict_adapter=SimpleNamespace(to_hf=lambda state: state),
        sampling_class=SimpleNamespace,
        features=detect_features(llm),
        threaded=False,  # the test places pulls between given steps
        steps_per_yield=1,
    )


@pytest.mark.parametrize("fake", [Fake026, Fake032])
def test_hot_swap_versions_are_the_same_with_or_without_vllm_labels(fake):
    """A request running across a pull carries both versions and tokens of both weights; a
    request arriving meanwhile waits for the prefix cache reset, then carries only the new
    one; a request after everything, only the new one. On 0.26 nothing calls
    set_weight_version (the fake has none: a call would fail)."""
    llm = fake()
    prompt = np.array([1, 2, 3])

    async def main():
        engine = _engine(llm)
        long = asyncio.ensure_future(
            engine.generate(prompt, request_id="long", sampling=SamplingParams(max_tokens=6))
        )
        while not any(len(t) >= 2 for _, t, _ in llm.requests.values()):
            await asyncio.sleep(0)
        engine.load_weights({"w": torch.tensor(1)}, 1)
        late = await engine.generate(
            prompt, request_id="late", sampling=SamplingParams(max_tokens=2)
        )
        after = await engine.generate(
            prompt, request_id="after", sampling=SamplingParams(max_tokens=2)
        )
        done = await long
        await engine.close()
        return done, late, after

    long, late, after = asyncio.run(main())
    assert set(long.token_ids_N.tolist()) == {0, 1}
    assert (long.policy_version_min, long.policy_version_max) == (0, 1)
    assert late.token_ids_N.tolist() == [1, 1]
    assert (late.policy_version_min, late.policy_version_max) == (1, 1)
    assert (after.policy_version_min, after.policy_version_max) == (1, 1)
    adds = [e for e in llm.events if e.startswith(("add", "finish"))]
    assert adds.index("finish long#0") < adds.index("add late#1"), "late waited for the reset"
    assert ("label 1" in llm.events) == (fake is Fake032)
    assert llm.events[-1] == "shutdown"


class FakeHolding(Fake026):
    """vLLM still holds a request the engine no longer tracks (one it let go of but vLLM
    has not finished): the prefix cache will not reset until a step finishes it."""

    def __init__(self):
        super().__init__()
        self.requests["leftover"] = (SimpleNamespace(max_tokens=1), [], [])


def test_a_pull_while_vllm_holds_an_untracked_request_does_not_stall_the_queue():
    llm = FakeHolding()

    async def main():
        engine = _engine(llm)
        engine.load_weights({"w": torch.tensor(1)}, 1)
        request = engine.generate(
            np.array([1, 2]), request_id="r", sampling=SamplingParams(max_tokens=2)
        )
        out = await asyncio.wait_for(request, timeout=10)
        await engine.close()
        return out

    out = asyncio.run(main())
    assert out.token_ids_N.tolist() == [1, 1]
    assert llm.events.index("finish leftover") < llm.events.index("add r#0")


def test_vllm_logs_keep_warnings_but_not_the_one_every_sync_repeats(package_logger_restored):
    import io
    import logging

    from torchtitan_rl.generation.vllm_engine import EXPECTED_RELOAD_WARNING, quiet_vllm_logs

    vllm_logger = logging.getLogger("vllm")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    vllm_logger.addHandler(handler)
    level = vllm_logger.level
    try:
        logging.getLogger("torchtitan_rl").setLevel(logging.WARNING)
        quiet_vllm_logs()
        vllm_logger.info("Loading weights took 0.1 s")
        vllm_logger.warning(EXPECTED_RELOAD_WARNING)
        vllm_logger.warning("KV cache is too small")
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(level)
    assert stream.getvalue() == "KV cache is too small\n"
