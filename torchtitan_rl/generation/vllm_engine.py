"""vLLM behind the generator's engine interface (`generator.backend = "vllm"`).

vLLM's engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), started from a
Hugging Face folder. The seam's `EngineFront` (generation/front.py) drives it like the
native engine, on the engine thread: pull weights (between engine steps, never inside one)
-> admit (our queue -> vLLM) -> an engine step, and again.

What the trainer needs from a completion, and how it comes out of vLLM:
- log-probs of the sampled tokens after temperature and top-k/top-p (`logprobs_mode =
  "processed_logprobs"`; greedy requests get log_softmax of the raw logits, as natively);
- the kept top-k/top-p support for replay: vLLM >= 0.28 returns sampling masks only from its
  Model Runner V2, which needs Triton on the device (the CPU build has none), so the support
  is read off the full processed log-prob row (`logprobs = -1`): the kept ids are the finite
  entries. Exact, and paid only by requests that ask for it (`return_support`);
- the policy version: a completion carries the lowest and highest version its tokens were
  sampled under, labelled by vLLM where the release can (`set_weight_version`), else (and
  whenever adapters are served) by the backend's own step bookkeeping
  (generation/vllm_support.py, which also gates releases).

Weights arrive with torchtitan names; they are renamed to Hugging Face's and loaded with
vLLM's in-place reload (`reload_weights`), which also handles its CPU kernels' repacked
layouts; tensors already on the GPU (CUDA IPC transport) load device to device
(`vllm_support.weight_path`, logged). The prefix cache is reset at every such pull, so no
request admitted afterwards reuses keys/values of older weights: with requests still running
(hot swap), vLLM can only reset once they have finished, so new requests wait in our queue
until then (or, with `recompute_on_sync`, the running ones are preempted and re-prefilled
under the new weights).

Served adapters ([lora] with lora.vllm_sync = "adapters", generation/vllm_lora.py): the
weights are the base; each version's adapters become a LoRA adapter of its own, which every
request admitted after the pull is served with. vLLM keys its prefix cache by adapter, so
nothing is reset and nobody waits. A running request cannot change adapter inside vLLM:
without `recompute_on_sync` it finishes under the adapter it was admitted with, and its
tokens carry that version (unless a new base came: then it is moved); with it, it is moved
onto the new adapter (its tokens so far re-prefilled under it as one new vLLM request,
later draws from a seed of their own), and its tokens carry both versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from torchtitan_rl.generation.backends import check_served_adapter_dtype
from torchtitan_rl.generation.front import EngineFront
from torchtitan_rl.generation.interface import AdapterUse, EngineConfig, error_completion
from torchtitan_rl.generation.vllm_lora import (
    MAX_LIVE_ADAPTERS,
    Adapter,
    AdapterSet,
    lora_engine_args,
    names_in_lora_layers,
    split_adapters,
)
from torchtitan_rl.generation.vllm_support import (
    VllmFeatures,
    check_vllm_version,
    detect_features,
    weight_path,
)
from torchtitan_rl.types import Completion, FinishReason, SamplingParams

logger = logging.getLogger(__name__)

EXPECTED_RELOAD_WARNING = "RotaryEmbedding: Failed to load weights"
"""vLLM says this at every weight reload: rotary embeddings hold no weights (their cos/sin
cache is computed), so nothing was loaded into them, as expected."""


def _not_expected(record: logging.LogRecord) -> bool:
    return record.getMessage() != EXPECTED_RELOAD_WARNING


def quiet_vllm_logs() -> None:
    """vLLM's own logger at WARNING unless this package logs at INFO (`--debug`), and without
    the warning every weight sync repeats (EXPECTED_RELOAD_WARNING): the run's console keeps
    the lines that say something."""
    vllm_logger = logging.getLogger("vllm")
    if not logging.getLogger("torchtitan_rl").isEnabledFor(logging.INFO):
        vllm_logger.setLevel(logging.WARNING)
    for handler in vllm_logger.handlers:
        if _not_expected not in handler.filters:
            handler.addFilter(_not_expected)


FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


@dataclass(kw_only=True, slots=True)
class _Pending:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    arrival_s: float
    admitted_s: float = 0.0
    first_token_s: float = 0.0
    """When an engine step first returned a token of it (0 until then)."""
    versions: set[int] = field(default_factory=set)
    """Versions its tokens were sampled under, where the backend labels them itself."""
    num_seen: int = 0
    """Output tokens of the current part already labelled."""
    adapter: Adapter | None = None
    """Served adapters: the adapter of its current part (None: the weights alone)."""
    done_ids: list[int] = field(default_factory=list)
    """Served adapters: tokens of its earlier parts (moved to a newer adapter at a pull:
    `_serve_adapter`), and their log-prob rows; the current part continues after them."""
    done_rows: list = field(default_factory=list)
    cached_tokens: int = 0
    """Prefix-cache hits of its earlier parts."""
    last: object = None
    """The current part's latest output from vLLM (a `RequestOutput`; None before one)."""
    vllm_id: str = ""
    """The current part's id in vLLM."""


def kv_cache_bytes(config: EngineConfig, hf_config: dict) -> int:
    """Bytes of `config.total_blocks()` KV blocks of this model (the native engine's sizing)."""
    head_dim = hf_config.get("head_dim") or (
        hf_config["hidden_size"] // hf_config["num_attention_heads"]
    )
    kv_heads = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    itemsize = torch.empty(0, dtype=getattr(torch, config.dtype)).element_size()
    per_token = 2 * hf_config["num_hidden_layers"] * kv_heads * head_dim * itemsize
    return config.total_blocks() * config.block_size * per_token


@contextlib.contextmanager
def _unscannable_modules_hidden():
    """While vLLM starts, modules holding an unbound werkzeug LocalProxy leave sys.modules.
    vLLM's CPU kernel overrides scan every module's attributes with `hasattr`
    (vllm/triton_utils/dispatcher.py, `_rebind_kernels`), and an unbound proxy (flask's
    `request`, `g`, ...; importing Monarch's job classes imports flask for its dashboard)
    raises RuntimeError there instead of AttributeError, so the engine failed to start."""
    try:
        from werkzeug.local import LocalProxy
    except ImportError:
        yield
        return
    hidden = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) or {}
        if any(issubclass(type(v), LocalProxy) for v in list(namespace.values())):
            hidden[name] = sys.modules.pop(name)
    try:
        yield
    finally:
        sys.modules.update(hidden)


def build_vllm_engine(
    model, config: EngineConfig, vocab_size: int, device, hf_folder: str, lora=None
):
    """The `generator.backend = "vllm"` factory (generation/backends.py): vLLM started from
    `hf_folder`, loading later weights through torchtitan's Qwen3 name mapping (`model`: a
    `ModelConfig`); serving [lora] versions as LoRA adapters when `lora` (a `LoRAConfig`)
    is on with vllm_sync = "adapters", else taking merged full weights."""
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    from torchtitan_rl.models.qwen3 import model_args

    adapter = Qwen3StateDictAdapter(model_args(model, vocab_size), None)
    serve = lora is not None and lora.enabled and lora.vllm_sync == "adapters"
    return start_vllm_engine(
        hf_folder, config, device, state_dict_adapter=adapter, lora=lora if serve else None
    )


def start_vllm_engine(
    hf_folder: str, config: EngineConfig, device: torch.device, *, state_dict_adapter,
    lora=None,
) -> VllmEngine:  # fmt: skip
    """vLLM started from `hf_folder` in this process, behind `VllmEngine`; with `lora` (a
    `LoRAConfig`) built with LoRA, serving each version's adapters (generation/vllm_lora.py).
    Raises ValueError (one line) for a vLLM release outside `vllm_support.SUPPORTED_VLLM`,
    and for served adapters in a dtype vLLM's GPU LoRA kernels do not take."""
    config = config.for_device(device.type)
    config.validate()
    if lora is not None:
        check_served_adapter_dtype("vllm", config.dtype, on_gpu=device.type == "cuda")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm import EngineArgs
    from vllm import SamplingParams as VllmSampling
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.llm_engine import LLMEngine

    with open(os.path.join(hf_folder, "config.json")) as f:
        hf_config = json.load(f)
    args = EngineArgs(
        model=hf_folder,
        skip_tokenizer_init=True,
        dtype=config.dtype,
        seed=0,
        max_model_len=config.max_seq_len,
        max_num_seqs=config.max_num_seqs,
        block_size=config.block_size,
        kv_cache_memory_bytes=kv_cache_bytes(config, hf_config),
        enable_prefix_caching=config.enable_prefix_cache,
        enforce_eager=device.type != "cuda" or not config.cuda_graphs,
        logprobs_mode="processed_logprobs",
        max_logprobs=-1,
        # its stat loggers took ~9% of the CPU time of a step in the loop (docs/benchmarks.md,
        # "vLLM in the loop"); the generator reports its own (generator/*)
        disable_log_stats=True,
        **({} if lora is None else lora_engine_args(lora, set(EngineArgs.__dataclass_fields__))),
    )
    quiet_vllm_logs()
    with _unscannable_modules_hidden():
        llm = LLMEngine.from_engine_args(args)
    features = detect_features(llm)
    logger.info("vLLM %s on %s: %s", vllm.__version__, device, features.describe())
    adapters = None
    if lora is not None:
        dtype = getattr(torch, config.dtype)
        adapters = AdapterSet(llm, LoRARequest, base=hf_folder, dtype=dtype)
        logger.info("vLLM serves [lora] versions as adapters (folders in %s)", adapters.root)
    return VllmEngine(
        llm,
        config,
        vocab_size=int(hf_config["vocab_size"]),
        state_dict_adapter=state_dict_adapter,
        sampling_class=VllmSampling,
        features=features,
        cleanup=cleanup_dist_env_and_memory,
        adapters=adapters,
        # the inline driver: behind the threaded one the loop's request pattern ran slower
        # on the GPU (docs/benchmarks.md, "In-loop request pattern"), and on CPU vLLM's
        # attention fails from a thread other than the one that started it
        threaded=False,
        # a step of vLLM is ~15 ms of mostly CPU: yielding after each one lets a finished
        # turn's reply leave and the next turn arrive at once (docs/benchmarks.md)
        steps_per_yield=1,
    )


class VllmEngine(EngineFront):
    """The generator engine over vLLM (module docstring), built by `start_vllm_engine`.
    Same interface as `Engine`: `generate`, `load_weights`, `policy_version`, `close`."""

    def __init__(
        self,
        llm,
        config: EngineConfig,
        *,
        vocab_size: int,
        state_dict_adapter,
        sampling_class: Callable,
        features: VllmFeatures,
        cleanup: Callable[[], None] = lambda: None,
        adapters: AdapterSet | None = None,
        threaded: bool = True,
        steps_per_yield: int = 8,
    ) -> None:
        """`llm`: a started vLLM `LLMEngine`; `sampling_class`: vLLM's `SamplingParams`;
        `cleanup`: run at close, after vLLM shut down (undoes its process group);
        `adapters`: the adapters of a vLLM built with LoRA (served [lora] versions), else
        None; `threaded`, `steps_per_yield`: the front's driver (generation/front.py)."""
        super().__init__(config, threaded=threaded, steps_per_yield=steps_per_yield)
        self.vocab_size = vocab_size
        self._llm = llm
        self._adapter = state_dict_adapter
        self._sampling_class = sampling_class
        self._features = features
        self._cleanup = cleanup
        self._adapters = adapters
        self.adapter_use = AdapterUse.FULL if adapters is None else AdapterUse.SERVE
        """How [lora] versions reach this engine (merged full weights, or served adapters)."""
        self._own_labels = adapters is not None or not features.weight_versions
        """Tokens labelled by the bookkeeping here, not by vLLM's weight version (which
        knows nothing of adapters)."""
        self._weights_version = 0
        """The version of the weights vLLM holds (a request without an adapter runs on
        them); with adapters the policy version is the current adapter's."""
        self._waiting: list[_Pending] = []
        self._running: dict[str, _Pending] = {}
        self._cache_stale = False
        self._next_id = 0
        self._weight_path = ""
        self._lora_names: Callable[[str], str] | None = None
        """With adapters: Hugging Face name -> the reload's (`names_in_lora_layers`)."""
        if adapters is not None:  # built with LoRA: its wrapped layers are known from now on
            self._lora_names = names_in_lora_layers(llm.collective_rpc("get_model")[0])
        if features.weight_versions:
            llm.set_weight_version("0")

    # ---- the verbs the front's loop calls (generation/interface.py) ----------------------
    def _enqueue(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        future: asyncio.Future,
        arrival_s: float,
    ) -> None:
        self._waiting.append(
            _Pending(
                request_id=request_id,
                prompt_ids=prompt_ids,
                sampling=sampling,
                future=future,
                arrival_s=arrival_s,
            )
        )

    def _has_waiting(self) -> bool:
        return bool(self._waiting)

    def _has_running(self) -> bool:
        return bool(self._running)

    def _may_admit(self) -> bool:
        """No request is admitted while a pull's prefix cache reset is still pending."""
        if self._cache_stale:
            self._cache_stale = not self._llm.reset_prefix_cache()
            if self._cache_stale and not self._running:
                # none of ours runs, yet vLLM still holds cache blocks (a request it has not
                # let go of): nothing else would step it, so the queue would wait for ever
                self._llm.step()
        return not self._cache_stale

    def _steps(self, num_steps: int) -> None:
        for _ in range(num_steps):
            if not self._running:
                break
            self._step()

    def _drop_all(self) -> list[asyncio.Future]:
        futures = [r.future for r in [*self._waiting, *self._running.values()]]
        if self._running and not self._closed:
            self._llm.abort_request(list(self._running))
        self._waiting.clear()
        self._running.clear()
        return futures

    def _shutdown(self) -> None:
        """Shuts vLLM down and undoes the process group its in-process engine core made
        (so the process can make its own)."""
        self._llm.engine_core.shutdown()
        self._llm = None
        self._cleanup()
        if self._adapters is not None:
            self._adapters.close()

    def model_parameters(self):
        """(name, tensor) of the model vLLM runs, in its own names and fused layouts (an
        in-process engine core: the tensors themselves)."""
        (model,) = self._llm.collective_rpc("get_model")
        return model.named_parameters()

    def _pull_weights(self, pending) -> None:
        """Full weights: reloaded in place (the prefix cache reset: module docstring).
        Served adapters (`AdapterUse.SERVE`): each version's adapters become the current
        adapter (the base's weights, which come with the first, are reloaded first);
        running requests keep theirs unless moved (`_serve_adapter`). A new base moves
        every running request: its adapter was trained on the old base, and the new base
        under it would be a policy no version is."""
        newest, moved = None, []
        for state, version, partial in pending:
            adapters, weights = split_adapters(state) if self._adapters else ({}, state)
            assert not partial or adapters, "vLLM takes full weights or adapters"
            if weights:
                if self._adapters is not None:  # before the reload: none runs on both bases
                    moved += list(self._running.values())
                    for request in self._running.copy().values():
                        self._abort_part(request)
                self._reload(weights, version)
            newest = (adapters, version) if adapters else None
            self._version = version
        if self._adapters is None:
            return
        self._adapters.clear_current()  # only the newest version is served
        if newest is not None:
            self._serve_adapter(self._adapters.prepare(*newest), moved)
        else:  # the weights alone (no adapters came with them)
            for request in moved:
                self._submit(request)
        self._retire()

    def _reload(self, weights, version: int) -> None:
        """Full weights (torchtitan names) into vLLM's parameters, in place, as version
        `version`; no request admitted afterwards reuses keys/values of the old weights."""
        path = weight_path(weights)
        if path != self._weight_path:
            logger.info("vLLM %s", path)
            self._weight_path = path
        hf_state = self._adapter.to_hf(weights)
        if self._lora_names is not None:  # built with LoRA: the wrapped layers' own weights
            hf_state = {self._lora_names(k): v for k, v in hf_state.items()}
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": hf_state.items()})
        if self._features.weight_versions:
            self._llm.set_weight_version(str(version))
        if self._own_labels:  # a batch may still be in flight under the old weights
            for request in self._running.values():
                request.versions.add(self._label(request))
        self._weights_version = version
        reset = self._llm.reset_prefix_cache(reset_running_requests=self.config.recompute_on_sync)
        self._cache_stale = not reset

    def _serve_adapter(self, newest: Adapter, moved: list[_Pending]) -> None:
        """`newest` becomes the adapter of every request admitted from now on. A running
        request cannot change adapter inside vLLM: with `recompute_on_sync` each one is
        moved onto `newest` (`_abort_part`, then `_submit`: its tokens so far become context
        re-prefilled under `newest`, the rest is generated after them), else it
        finishes under its own adapter, its tokens labelled with that adapter's version.
        Either way none reads keys/values of another adapter (the prefix cache is keyed by
        adapter). At most MAX_LIVE_ADAPTERS stay registered: past that, the requests of
        the oldest adapters are moved too. Adapters no running request uses are removed.
        `moved`: requests already taken out of vLLM (a new base), to submit under `newest`."""
        running = list(self._running.values())
        if self.config.recompute_on_sync:
            also = running
        else:  # ids grow with each load: the first are the oldest
            in_use = sorted({r.adapter.id for r in running if r.adapter is not None})
            excess = set(in_use[: max(0, len(in_use) - (MAX_LIVE_ADAPTERS - 1))])
            also = [r for r in running if r.adapter is not None and r.adapter.id in excess]
        for request in also:
            self._abort_part(request)
        moved = moved + also
        self._retire()  # room for `newest`
        self._adapters.add(newest)
        for request in moved:
            self._submit(request)

    def _retire(self) -> None:
        if self._adapters is not None:
            in_use = {r.adapter.id for r in self._running.values() if r.adapter is not None}
            self._adapters.retire(in_use)

    def _label(self, request: _Pending) -> int:
        """The version the current part of `request` samples under (own labels)."""
        return self._weights_version if request.adapter is None else request.adapter.version

    def _admit(self, started_only: bool = False) -> None:
        if started_only:  # vLLM preempts inside its own queue: none of ours has started
            return
        now = time.perf_counter()
        for request in self._waiting:
            request.admitted_s = now
            self._submit(request)
        self._waiting.clear()

    def _submit(self, request: _Pending) -> None:
        """Hands `request` to vLLM (after its earlier parts' tokens, under the current
        adapter); a request vLLM refuses fails alone, as an error completion."""
        s = request.sampling
        context = request.prompt_ids + request.done_ids
        room = self.config.max_seq_len - len(context)
        seed = s.seed
        if request.done_ids and seed is not None:  # a later part: draws of its own
            seed = (seed * 1_000_003 + len(request.done_ids)) % 2**63
        params = self._sampling_class(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=seed,
            max_tokens=min(s.max_tokens - len(request.done_ids), room),
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=True,  # stops are exactly `stop_token_ids`, as natively
            logprobs=-1 if s.return_support and s.temperature > 0 else 0,
            detokenize=False,
        )
        request.adapter = self._adapters.current if self._adapters is not None else None
        lora = {} if request.adapter is None else {"lora_request": request.adapter.request}
        vllm_id = f"{request.request_id}#{self._next_id}"
        self._next_id += 1
        try:
            self._llm.add_request(vllm_id, {"prompt_token_ids": context}, params, **lora)
        except Exception as e:  # vLLM refused this request: it alone fails
            error = f"{type(e).__name__}: {e}"
            self._complete(
                request.future, error_completion(request.request_id, error, self._version)
            )
            return
        request.vllm_id = vllm_id
        self._running[vllm_id] = request

    def _abort_part(self, request: _Pending) -> None:
        """Ends the current part of a running request in vLLM, keeping its tokens as
        earlier parts' (`_serve_adapter` submits the rest under the newest adapter)."""
        self._llm.abort_request([request.vllm_id])
        del self._running[request.vllm_id]
        if request.last is not None:
            out = request.last.outputs[0]
            request.done_ids += list(out.token_ids)
            request.done_rows += list(out.logprobs or [])
            request.cached_tokens += request.last.num_cached_tokens or 0
        request.last, request.num_seen = None, 0

    def _step(self) -> None:
        for vllm_id in [k for k, r in self._running.items() if r.future.done()]:  # cancelled
            self._llm.abort_request([vllm_id])
            del self._running[vllm_id]
        if not self._running:
            return
        finished = False
        for output in self._llm.step():
            request = self._running.get(output.request_id)
            if request is None:
                continue
            request.last = output
            if not request.first_token_s and output.outputs and output.outputs[0].token_ids:
                request.first_token_s = time.perf_counter()
            if self._own_labels:
                num_tokens = len(output.outputs[0].token_ids)
                if num_tokens > request.num_seen:
                    request.versions.add(self._label(request))
                    request.num_seen = num_tokens
            if output.finished:
                finished = True
                del self._running[output.request_id]
                if not request.future.done():
                    self._complete(request.future, self._completion(request, output))
        if finished:
            self._retire()

    def _completion(self, request: _Pending, output) -> Completion:
        out = output.outputs[0]
        token_ids = np.asarray(request.done_ids + list(out.token_ids), dtype=np.int32)
        rows = request.done_rows + list(out.logprobs or [])
        logprobs = np.asarray([row[t].logprob for row, t in zip(rows, token_ids)], np.float32)
        support_ids = support_offsets = None
        if request.sampling.return_support:
            if request.sampling.temperature > 0:
                kept = [
                    sorted(t for t, lp in row.items() if lp.logprob > -math.inf) for row in rows
                ]
            else:  # greedy: the full vocabulary, as natively
                kept = [range(self.vocab_size)] * len(token_ids)
            support_ids = np.concatenate([np.asarray(k, np.int32) for k in kept] or [[]]).astype(
                np.int32
            )
            sizes = [len(k) for k in kept]
            support_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        if self._own_labels:
            versions = sorted(request.versions)
        else:
            versions = [int(span.version) for span in out.weight_versions or []]
        versions = versions or [self._version]
        now = time.perf_counter()
        cached = request.cached_tokens + (output.num_cached_tokens or 0)
        return Completion(
            request_id=request.request_id,
            token_ids_N=token_ids,
            logprobs_N=logprobs,
            finish_reason=FINISH_REASONS.get(out.finish_reason, FinishReason.ABORT),
            policy_version_min=min(versions),
            policy_version_max=max(versions),
            support_ids=support_ids,
            support_offsets=support_offsets,
            metrics={
                "generator/queue_time_ms": 1e3 * (request.admitted_s - request.arrival_s),
                "generator/time_to_first_token_ms": 1e3
                * ((request.first_token_s or now) - request.arrival_s),
                "generator/decode_time_ms": 1e3 * (now - (request.first_token_s or now)),
                "generator/inflight_at_completion": float(len(self._running) + 1),
                "generator/prefix_hit_tokens": float(cached),
            },
        )
