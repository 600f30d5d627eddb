"""vLLM behind the generator's engine interface (`generator.backend = "vllm"`).

vLLM's engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), started from a
Hugging Face folder. An asyncio task drives it like the native engine's loop:

    PULL_WEIGHTS (between engine steps, never inside one) -> ADMIT (our queue -> vLLM)
    -> up to `max_steps_per_iteration` engine steps -> yield to the event loop

What the trainer needs from a completion, and how it comes out of vLLM:
- log-probs of the sampled tokens after temperature and top-k/top-p (`logprobs_mode =
  "processed_logprobs"`; greedy requests get log_softmax of the raw logits, as natively);
- the kept top-k/top-p support for replay: vLLM >= 0.28 returns sampling masks only from its
  Model Runner V2, which needs Triton on the device (the CPU build has none), so the support
  is read off the full processed log-prob row (`logprobs = -1`): the kept ids are the finite
  entries. Exact, and paid only by requests that ask for it (`return_support`);
- the policy version: every `load_weights` labels vLLM's weight version, and a completion
  carries the lowest and highest version its tokens were sampled under.

Weights arrive with torchtitan names; they are renamed to Hugging Face's and loaded with
vLLM's in-place reload (`reload_weights`), which also handles its CPU kernels' repacked
layouts. The prefix cache is reset at every pull, so no request admitted afterwards reuses
keys/values of older weights: with requests still running (hot swap), vLLM can only reset
once they have finished, so new requests wait in our queue until then (or, with
`recompute_on_sync`, the running ones are preempted and re-prefilled under the new weights).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from torchtitan_rl.generation.engine import EngineConfig, request_error
from torchtitan_rl.types import Completion, FinishReason, SamplingParams

FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
CPU_BLOCK_MULTIPLE = 32
"""vLLM's CPU attention needs KV blocks of a multiple of 32 tokens."""


@dataclass(kw_only=True, slots=True)
class _Pending:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    arrival_s: float
    admitted_s: float = 0.0
    versions: list[int] = field(default_factory=list)


def kv_cache_bytes(config: EngineConfig, hf_config: dict) -> int:
    """Bytes of `config.total_blocks()` KV blocks of this model (the native engine's sizing)."""
    head_dim = hf_config.get("head_dim") or (
        hf_config["hidden_size"] // hf_config["num_attention_heads"]
    )
    kv_heads = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    itemsize = torch.empty(0, dtype=getattr(torch, config.dtype)).element_size()
    per_token = 2 * hf_config["num_hidden_layers"] * kv_heads * head_dim * itemsize
    return config.total_blocks() * config.block_size * per_token


class VllmEngine:
    """The generator engine over vLLM (module docstring). Same interface as `Engine`:
    `generate`, `load_weights`, `policy_version`, `close`."""

    def __init__(
        self,
        hf_folder: str,
        config: EngineConfig,
        device: torch.device,
        *,
        state_dict_adapter,
    ) -> None:
        config.validate()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        import json

        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        hf_config = json.loads(open(os.path.join(hf_folder, "config.json")).read())
        self.config = config
        self.vocab_size = int(hf_config["vocab_size"])
        self._adapter = state_dict_adapter
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
        )
        self._llm = LLMEngine.from_engine_args(args)
        self._version = 0
        self._llm.set_weight_version("0")
        self._waiting: list[_Pending] = []
        self._running: dict[str, _Pending] = {}
        self._pending_weights: list[tuple[dict[str, torch.Tensor], int]] = []
        self._cache_stale = False
        self._next_id = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self._version

    async def generate(
        self,
        prompt_ids: np.ndarray,
        *,
        request_id: str,
        session_id: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> Completion:
        """One completion; an invalid request comes back as an ERROR completion. Multi-turn
        sessions and group siblings share blocks through vLLM's prefix cache."""
        if self._closed:
            raise RuntimeError("engine closed")
        sampling = sampling if sampling is not None else SamplingParams()
        error = request_error(prompt_ids, sampling, self.config.max_seq_len, self.vocab_size)
        if error is not None:
            return self._error(request_id, error)
        self._ensure_loop()
        request = _Pending(
            request_id=request_id,
            prompt_ids=np.asarray(prompt_ids).astype(np.int64).tolist(),
            sampling=sampling,
            future=asyncio.get_running_loop().create_future(),
            arrival_s=time.perf_counter(),
        )
        self._waiting.append(request)
        self._wake.set()
        return await request.future

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Queues new weights (torchtitan names, full tensors), applied between steps."""
        if self._closed:
            raise RuntimeError("engine closed")
        self._pending_weights.append((state, version))
        if self._task is None:
            self._pull_weights()
        else:
            self._wake.set()

    async def close(self) -> None:
        """Fails outstanding requests, stops the loop, shuts vLLM down and undoes the
        process group its in-process engine core made (so the process can make its own)."""
        if self._closed:
            return
        self._closed = True
        self._fail_all("engine closed")
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self._llm.engine_core.shutdown()
        del self._llm
        cleanup_dist_env_and_memory()

    # ---- the loop ---------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        elif self._task.done():
            raise RuntimeError("engine loop stopped") from self._task.exception()

    async def _loop(self) -> None:
        try:
            while True:
                if not (self._waiting or self._running or self._pending_weights):
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._iteration()
                await asyncio.sleep(0)
        except Exception as exc:
            self._fail_all(f"engine loop failed: {exc!r}")
            raise

    def _iteration(self) -> None:
        drain = self.config.weight_sync_mode == "drain"
        if self._pending_weights and not (drain and self._running):
            self._pull_weights()
        if self._cache_stale:
            self._cache_stale = not self._llm.reset_prefix_cache()
        if self._waiting and not self._cache_stale and not (drain and self._pending_weights):
            self._admit()
        for _ in range(self.config.max_steps_per_iteration):
            if not self._running:
                break
            self._step()

    def _pull_weights(self) -> None:
        for state, version in self._pending_weights:
            hf_state = self._adapter.to_hf(state)
            self._llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": hf_state.items()}
            )
            self._version = version
        self._pending_weights.clear()
        self._llm.set_weight_version(str(self._version))
        reset = self._llm.reset_prefix_cache(reset_running_requests=self.config.recompute_on_sync)
        self._cache_stale = not reset

    def _admit(self) -> None:
        from vllm import SamplingParams as VllmSampling

        now = time.perf_counter()
        for request in self._waiting:
            s = request.sampling
            room = self.config.max_seq_len - len(request.prompt_ids)
            params = VllmSampling(
                n=1,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                seed=s.seed,
                max_tokens=min(s.max_tokens, room),
                stop_token_ids=list(s.stop_token_ids),
                ignore_eos=True,  # stops are exactly `stop_token_ids`, as natively
                logprobs=-1 if s.return_support and s.temperature > 0 else 0,
                detokenize=False,
            )
            vllm_id = f"{request.request_id}#{self._next_id}"
            self._next_id += 1
            try:
                self._llm.add_request(vllm_id, {"prompt_token_ids": request.prompt_ids}, params)
            except Exception as e:  # vLLM refused this request: it alone fails
                if not request.future.done():
                    request.future.set_result(
                        self._error(request.request_id, f"{type(e).__name__}: {e}")
                    )
                continue
            request.admitted_s = now
            self._running[vllm_id] = request
        self._waiting.clear()

    def _step(self) -> None:
        for vllm_id in [k for k, r in self._running.items() if r.future.done()]:  # cancelled
            self._llm.abort_request([vllm_id])
            del self._running[vllm_id]
        if not self._running:
            return
        for output in self._llm.step():
            if output.finished and output.request_id in self._running:
                request = self._running.pop(output.request_id)
                if not request.future.done():
                    request.future.set_result(self._completion(request, output))

    def _completion(self, request: _Pending, output) -> Completion:
        out = output.outputs[0]
        token_ids = np.asarray(out.token_ids, dtype=np.int32)
        rows = out.logprobs or []
        logprobs = np.asarray([row[t].logprob for row, t in zip(rows, out.token_ids)], np.float32)
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
        versions = [int(span.version) for span in out.weight_versions or []] or [self._version]
        now = time.perf_counter()
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
                "generator/decode_time_ms": 1e3 * (now - request.admitted_s),
                "generator/inflight_at_completion": float(len(self._running) + 1),
                "generator/prefix_hit_tokens": float(output.num_cached_tokens or 0),
            },
        )

    def _error(self, request_id: str, error: str) -> Completion:
        return Completion(
            request_id=request_id,
            token_ids_N=np.zeros(0, dtype=np.int32),
            logprobs_N=np.zeros(0, dtype=np.float32),
            finish_reason=FinishReason.ERROR,
            policy_version_min=self._version,
            policy_version_max=self._version,
            error=error,
        )

    def _fail_all(self, message: str) -> None:
        for request in [*self._waiting, *self._running.values()]:
            if not request.future.done():
                request.future.set_exception(RuntimeError(message))
        if self._running and not self._closed:
            self._llm.abort_request(list(self._running))
        self._waiting.clear()
        self._running.clear()
