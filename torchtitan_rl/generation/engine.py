"""The native generation engine: asyncio front, continuous batching over a KV cache.

`generate` validates a request, puts it in the inbox and awaits its future. One background
task (started on the first request, on the running loop) repeats an iteration:

    apply queued weights -> admit inbox into free slots (batched prefill, first token)
    -> up to `max_steps_per_iteration` batched decode steps over every running sequence,
       resolving each request as soon as it finishes -> yield to the event loop

and sleeps on an event while there is nothing to do. Forwards are synchronous inside the
task, so nothing else on the loop (a weight update, a new request, `close`) can interleave
with one. Each request samples with its own generator seeded from `SamplingParams.seed`,
so its tokens do not depend on what else is in the batch or when it was admitted.

No Monarch import here: the generator actor is a thin adapter around this class.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from torchtitan.models.qwen3 import Qwen3Model

from torchtitan_rl.generation.model_runner import ModelRunner
from torchtitan_rl.generation.sampling import sample_tokens
from torchtitan_rl.types import Completion, FinishReason, SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Native engine settings; TOML section [generator]."""

    max_num_seqs: int = 64
    """Concurrent sequences (KV cache slots), >= 1."""
    max_seq_len: int = 1024
    """Prompt + output tokens per sequence, >= 2; prompts may hold at most max_seq_len - 1."""
    dtype: str = "float32"
    """Weights, activations and KV cache dtype: "float32" | "bfloat16"."""
    max_steps_per_iteration: int = 8
    """Decode steps between yields to the event loop (new requests join at yields), >= 1."""

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_steps_per_iteration < 1:
            raise ValueError(
                f"max_steps_per_iteration must be >= 1, got {self.max_steps_per_iteration}"
            )


@dataclass(eq=False, slots=True)
class _Request:
    """One admitted-or-queued request and what it has sampled so far."""

    request_id: str
    prompt_ids: torch.Tensor
    sampling: SamplingParams
    future: asyncio.Future[Completion]
    generator: torch.Generator
    arrival_s: float
    slot: int = -1
    admitted_s: float = 0.0
    first_token_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    support: list[np.ndarray] = field(default_factory=list)
    version_min: int = 0
    version_max: int = 0


class Engine:
    """Continuous-batching generation on one device (see the module docstring).

    Call every method from the event loop thread the engine runs on.
    """

    def __init__(
        self, model: Qwen3Model, config: EngineConfig, device: torch.device | str = "cpu"
    ) -> None:
        config.validate()
        self.config = config
        self._runner = ModelRunner(
            model,
            max_slots=config.max_num_seqs,
            max_seq_len=config.max_seq_len,
            device=device,
            dtype=DTYPES[config.dtype],
        )
        self._inbox: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._pending_weights: list[tuple[dict[str, torch.Tensor], int]] = []
        self._version = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def policy_version(self) -> int:
        """Version of the weights the engine computes with now."""
        return self._version

    async def generate(
        self,
        prompt_ids: np.ndarray,
        *,
        request_id: str,
        session_id: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> Completion:
        """Generates one completion. An invalid request comes back as an ERROR completion.

        `session_id` is accepted for the GenerateFn seam (prefix reuse comes later).
        Raises RuntimeError("engine closed") if the engine is or gets closed.
        """
        if self._closed:
            raise RuntimeError("engine closed")
        sampling = sampling if sampling is not None else SamplingParams()
        error = self._request_error(prompt_ids, sampling)
        if error is not None:
            return Completion(
                request_id=request_id,
                token_ids_N=np.zeros(0, dtype=np.int32),
                logprobs_N=np.zeros(0, dtype=np.float32),
                finish_reason=FinishReason.ERROR,
                policy_version_min=self._version,
                policy_version_max=self._version,
                error=error,
            )
        self._ensure_loop()
        request = _Request(
            request_id=request_id,
            prompt_ids=torch.from_numpy(np.asarray(prompt_ids, dtype=np.int64)),
            sampling=sampling,
            future=asyncio.get_running_loop().create_future(),
            generator=torch.Generator().manual_seed(sampling.seed),
            arrival_s=time.perf_counter(),
        )
        self._inbox.append(request)
        self._wake.set()
        return await request.future

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Queues new weights (torchtitan names); the loop copies them in between steps.

        Running requests continue under the new weights. The engine keeps references to
        the tensors until they are applied, so do not modify them in the meantime.
        """
        if self._closed:
            raise RuntimeError("engine closed")
        self._pending_weights.append((state, version))
        if self._task is None:
            self._apply_weights()  # no loop yet, so no forward can be running
        else:
            self._wake.set()

    async def close(self) -> None:
        """Fails every outstanding request with RuntimeError("engine closed"), stops the loop."""
        if self._closed:
            return
        self._closed = True
        self._fail_all("engine closed")
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _request_error(self, prompt_ids: np.ndarray, sampling: SamplingParams) -> str | None:
        prompt = np.asarray(prompt_ids)
        limit = self.config.max_seq_len - 1
        vocab = self._runner.vocab_size
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            return f"prompt_ids must be a 1-D integer array, got {prompt.dtype} {prompt.shape}"
        if not 1 <= prompt.shape[0] <= limit:
            return f"prompt_ids has {prompt.shape[0]} tokens, must be in [1, {limit}]"
        if prompt.min() < 0 or prompt.max() >= vocab:
            return f"prompt_ids must be in [0, {vocab}), got [{prompt.min()}, {prompt.max()}]"
        try:
            sampling.validate()
        except ValueError as exc:
            return f"sampling: {exc}"
        return None

    def _ensure_loop(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        elif self._task.done():
            raise RuntimeError("engine loop stopped") from self._task.exception()

    async def _loop(self) -> None:
        try:
            while True:
                if not (self._inbox or self._running or self._pending_weights):
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._iteration()
                await asyncio.sleep(0)
        except Exception as exc:
            self._fail_all(f"engine loop failed: {exc!r}")
            raise

    def _iteration(self) -> None:
        self._apply_weights()
        self._admit()
        for _ in range(self.config.max_steps_per_iteration):
            self._drop_cancelled()
            if not self._running:
                break
            requests = list(self._running)
            last_N = torch.tensor([r.token_ids[-1] for r in requests])
            logits_NV = self._runner.decode([r.slot for r in requests], last_N)
            self._sample(requests, logits_NV)

    def _apply_weights(self) -> None:
        for state, version in self._pending_weights:
            self._runner.load_state_dict(state)
            self._version = version
        self._pending_weights.clear()

    def _admit(self) -> None:
        admitted: list[_Request] = []
        now = time.perf_counter()
        while self._inbox and self._runner.kv_cache.allocator.num_free:
            request = self._inbox.popleft()
            if request.future.done():  # the caller gave up while it was queued
                continue
            request.slot = self._runner.kv_cache.allocate()
            request.admitted_s = now
            admitted.append(request)
        if admitted:
            logits_NV = self._runner.prefill(
                [r.slot for r in admitted], [r.prompt_ids for r in admitted]
            )
            self._running.extend(admitted)
            self._sample(admitted, logits_NV)

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._running if r.future.done()]:
            self._running.remove(request)
            self._runner.kv_cache.free(request.slot)

    def _sample(self, requests: list[_Request], logits_NV: torch.Tensor) -> None:
        """Samples the next token of each request, then resolves those that finished."""
        device = logits_NV.device
        params = [r.sampling for r in requests]
        out = sample_tokens(
            logits_NV,
            temperature_N=torch.tensor([p.temperature for p in params], device=device),
            top_p_N=torch.tensor([p.top_p for p in params], device=device),
            top_k_N=torch.tensor([p.top_k for p in params], device=device),
            generators=[r.generator for r in requests],
            return_support=any(p.return_support for p in params),
        )
        now = time.perf_counter()
        token_ids, logprobs = out.token_ids_N.tolist(), out.logprobs_N.tolist()
        for i, request in enumerate(requests):
            if not request.token_ids:
                request.first_token_s = now
                request.version_min = request.version_max = self._version
            request.token_ids.append(token_ids[i])
            request.logprobs.append(logprobs[i])
            request.version_min = min(request.version_min, self._version)
            request.version_max = max(request.version_max, self._version)
            if request.sampling.return_support:
                assert out.support is not None
                request.support.append(out.support[i].cpu().numpy())
        inflight = len(self._running)
        for request in requests:
            reason = self._finish_reason(request)
            if reason is not None:
                self._running.remove(request)
                self._runner.kv_cache.free(request.slot)
                self._resolve(request, reason, now, inflight)

    def _finish_reason(self, request: _Request) -> FinishReason | None:
        if request.token_ids[-1] in request.sampling.stop_token_ids:
            return FinishReason.STOP
        num_tokens = len(request.token_ids)
        if num_tokens >= request.sampling.max_tokens:
            return FinishReason.LENGTH
        if request.prompt_ids.numel() + num_tokens >= self.config.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _resolve(self, request: _Request, reason: FinishReason, now: float, inflight: int) -> None:
        support_ids = support_offsets = None
        if request.sampling.return_support:
            sizes = [len(s) for s in request.support]
            support_ids = np.concatenate(request.support).astype(np.int32)
            support_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        completion = Completion(
            request_id=request.request_id,
            token_ids_N=np.asarray(request.token_ids, dtype=np.int32),
            logprobs_N=np.asarray(request.logprobs, dtype=np.float32),
            finish_reason=reason,
            policy_version_min=request.version_min,
            policy_version_max=request.version_max,
            support_ids=support_ids,
            support_offsets=support_offsets,
            metrics={
                "generator/queue_time_ms": 1e3 * (request.admitted_s - request.arrival_s),
                "generator/time_to_first_token_ms": 1e3
                * (request.first_token_s - request.arrival_s),
                "generator/decode_time_ms": 1e3 * (now - request.first_token_s),
                "generator/inflight_at_completion": float(inflight),
            },
        )
        if not request.future.done():
            request.future.set_result(completion)

    def _fail_all(self, message: str) -> None:
        for request in [*self._inbox, *self._running]:
            if request.slot >= 0 and request in self._running:
                self._runner.kv_cache.free(request.slot)
            if not request.future.done():
                request.future.set_exception(RuntimeError(message))
        self._inbox.clear()
        self._running.clear()
