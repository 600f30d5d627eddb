"""The native generation engine: asyncio front, continuous batching over a paged KV cache.

`generate` validates a request, puts it in the queue and awaits its future. One background
task (started on the first request, on the running loop) repeats an iteration of explicit
decisions (`Action`s):

    PULL_WEIGHTS (hot swap: now; drain: once nothing runs) -> ADMIT (queue -> batch)
    -> up to `max_steps_per_iteration` STEPs (one forward over every running request,
       resolving each as soon as it finishes) -> yield to the event loop

and sleeps on an event while there is nothing to do. Forwards are synchronous inside the
task, so nothing else on the loop (a weight update, a new request, `close`) can interleave
with one.

Each request samples with its own generator seeded from `SamplingParams.seed`, so its
tokens do not depend on what else is in the batch or when it was admitted.

No Monarch import here: the generator actor is a thin adapter around this class.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch
from torchtitan.models.qwen3 import Qwen3Model

from torchtitan_rl.checks import check_range
from torchtitan_rl.device import DTYPES, to_device_async
from torchtitan_rl.generation.block_manager import BlockManager
from torchtitan_rl.generation.cuda_graphs import DecodeGraphs
from torchtitan_rl.generation.model_runner import DECODE_ATTENTION, ModelRunner
from torchtitan_rl.generation.sampling import RowPlan, SampleResult, sample_tokens
from torchtitan_rl.generation.scheduler import Request, Scheduler
from torchtitan_rl.types import Completion, FinishReason, SamplingParams

WEIGHT_SYNC_MODES = ("hot_swap", "drain")
BACKENDS = ("native", "vllm")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Generator settings; TOML section [generator]. Both backends read them, except where a
    key says "native only"."""

    backend: str = "native"
    """"native" (this package's engine) | "vllm" (vLLM in the generator process, started
    from a Hugging Face folder; `pip install` the vllm extra, README)."""
    num_replicas: int = 1
    """Generator replicas (each its own process and engine) behind a session-affine router;
    weights are pushed to all of them after every step."""
    max_num_seqs: int = 64
    """Concurrent sequences in the running batch, >= 1."""
    max_seq_len: int = 1024
    """Prompt + output tokens per sequence, >= 2; prompts may hold at most max_seq_len - 1."""
    dtype: str = "float32"
    """Weights, activations and KV cache dtype: "float32" | "bfloat16"."""
    max_steps_per_iteration: int = 8
    """Decode steps between yields to the event loop (new requests join at yields), >= 1."""
    block_size: int = 16
    """Tokens per KV cache block (the unit of allocation and of prefix reuse), >= 1; vllm on
    CPU: a multiple of 32."""
    num_blocks: int = 0
    """KV cache blocks; 0 sizes the cache for max_num_seqs full-length sequences. Fewer
    blocks admit fewer requests at once and preempt (recompute) when the cache fills; at
    least ceil(max_seq_len / block_size)."""
    enable_prefix_cache: bool = True
    """Reuse cached blocks of earlier sequences whose tokens a new prompt starts with."""
    weight_sync_mode: str = "hot_swap"
    """"hot_swap": running requests continue under new weights from their next token;
    "drain": stop admitting, finish running requests, then swap (never mixes versions)."""
    recompute_on_sync: bool = False
    """After a weight pull, re-prefill running requests under the new weights (their blocks
    are then shareable again). Either way no request admitted after a pull reuses keys/values
    of older weights: the native prefix cache is keyed by weight load; vLLM's is reset, and
    without this key requests arriving while older ones run wait until those finish."""
    decode_attention: str = "auto"
    """Native only. Decode-step attention: "auto" (triton on CUDA, else gather) | "gather" (any device) |
    "triton" (paged kernel, CUDA only)."""
    cuda_graphs: bool = True
    """On a CUDA device, compile the decode layers with torch.compile and capture the decode
    step as CUDA graphs (one per batch and context bucket, at engine start; vllm: its
    torch.compile and CUDA graphs, else eager); no effect on CPU."""

    def validate(self) -> None:
        for name in ("num_replicas", "max_num_seqs", "max_steps_per_iteration", "block_size"):
            check_range(f"generator.{name}", getattr(self, name), ge=1)
        check_range("generator.max_seq_len", self.max_seq_len, ge=2)
        if self.dtype not in DTYPES:
            raise ValueError(f"generator.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        min_blocks = -(-self.max_seq_len // self.block_size)
        if self.num_blocks != 0 and self.num_blocks < min_blocks:
            raise ValueError(
                f"generator.num_blocks must be 0 or >= ceil(max_seq_len / block_size) = "
                f"{min_blocks}, got {self.num_blocks}"
            )
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"generator.decode_attention must be one of {DECODE_ATTENTION}, "
                f"got {self.decode_attention!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "vllm" and self.decode_attention != "auto":
            raise ValueError(
                f"decode_attention={self.decode_attention!r} is native only: vLLM picks its "
                'own attention; remove it or use backend = "native"'
            )
        if self.weight_sync_mode not in WEIGHT_SYNC_MODES:
            raise ValueError(
                f"weight_sync_mode must be one of {WEIGHT_SYNC_MODES}, "
                f"got {self.weight_sync_mode!r}"
            )

    def total_blocks(self) -> int:
        return self.num_blocks or self.max_num_seqs * -(-self.max_seq_len // self.block_size)


@dataclass(kw_only=True, slots=True)
class RowParams:
    """Sampling settings of each row of a step, as the sampler takes them; kept while the
    running batch stays the same (most steps), so they are not rebuilt every step."""

    requests: list[Request]
    temperature_N: torch.Tensor
    top_p_N: torch.Tensor
    top_k_N: torch.Tensor
    generators: list[torch.Generator]
    return_support: bool
    plan: RowPlan

    @classmethod
    def of(cls, requests: list[Request], device: torch.device) -> RowParams:
        params = [r.sampling for r in requests]
        return cls(
            plan=RowPlan.of(
                [p.temperature for p in params],
                [p.top_p for p in params],
                [p.top_k for p in params],
            ),
            requests=requests,
            temperature_N=to_device_async(torch.tensor([p.temperature for p in params]), device),
            top_p_N=to_device_async(torch.tensor([p.top_p for p in params]), device),
            top_k_N=to_device_async(torch.tensor([p.top_k for p in params]), device),
            generators=[r.generator for r in requests],
            return_support=any(p.return_support for p in params),
        )


@dataclass(slots=True)
class _Sampled:
    """A step's sampling as queued on the device: `token_ids_N` / `logprobs_N` are host
    copies (pinned, on CUDA) that are valid once `ready` (None: already) has passed."""

    result: SampleResult
    token_ids_N: torch.Tensor
    logprobs_N: torch.Tensor
    ready: torch.cuda.Event | None
    support_wanted: bool


def request_error(
    prompt_ids: np.ndarray, sampling: SamplingParams, max_seq_len: int, vocab_size: int
) -> str | None:
    """Why a request cannot be served (one line), or None; either backend answers it with
    an ERROR completion."""
    prompt = np.asarray(prompt_ids)
    limit = max_seq_len - 1
    if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
        return f"prompt_ids must be a 1-D integer array, got {prompt.dtype} {prompt.shape}"
    if not 1 <= prompt.shape[0] <= limit:
        return f"prompt_ids has {prompt.shape[0]} tokens, must be in [1, {limit}]"
    if prompt.min() < 0 or prompt.max() >= vocab_size:
        return f"prompt_ids must be in [0, {vocab_size}), got [{prompt.min()}, {prompt.max()}]"
    try:
        sampling.validate()
    except ValueError as exc:
        return f"sampling: {exc}"
    return None


class ActionKind(StrEnum):
    ADMIT = "admit"
    STEP = "step"
    PULL_WEIGHTS = "pull_weights"


@dataclass(kw_only=True, slots=True)
class Action:
    """One loop decision. STEP carries how many forwards to run (`Engine._steps`),
    PULL_WEIGHTS the version to apply; ADMIT only changes the scheduler's bookkeeping."""

    kind: ActionKind
    num_steps: int | None = None
    version: int | None = None


class Engine:
    """Continuous-batching generation on one device (see the module docstring).

    Call every method from the event loop thread the engine runs on.
    """

    def __init__(
        self,
        model: Qwen3Model,
        config: EngineConfig,
        device: torch.device | str = "cpu",
        *,
        look_ahead: bool | None = None,
    ) -> None:
        """`look_ahead`: queue each forward before reading the previous step's tokens
        (`_steps`); None: on CUDA, where it keeps the device busy while the host records
        tokens. On CPU it only adds a wasted row per finished request (tests turn it on
        there to check it changes no result)."""
        config.validate()
        self.config = config
        self._runner = ModelRunner(
            model,
            num_blocks=config.total_blocks(),
            block_size=config.block_size,
            max_seq_len=config.max_seq_len,
            device=device,
            dtype=DTYPES[config.dtype],
            decode_attention=config.decode_attention,
        )
        if config.cuda_graphs and self._runner.device.type == "cuda":
            self._runner.decode_graphs = DecodeGraphs(self._runner, max_batch=config.max_num_seqs)
        blocks = BlockManager(
            config.total_blocks(),
            config.block_size,
            enable_prefix_cache=config.enable_prefix_cache,
        )
        self._sched = Scheduler(blocks, max_num_seqs=config.max_num_seqs)
        self._look_ahead = self._runner.device.type == "cuda" if look_ahead is None else look_ahead
        self._pending_weights: list[tuple[dict[str, torch.Tensor], int]] = []
        self._rows: RowParams | None = None
        self._version = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def policy_version(self) -> int:
        """Version of the weights the engine computes with now."""
        return self._version

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    async def generate(
        self,
        prompt_ids: np.ndarray,
        *,
        request_id: str,
        session_id: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> Completion:
        """Generates one completion. An invalid request comes back as an ERROR completion.

        `session_id` needs no special handling: a turn that extends an earlier turn's
        tokens finds them in the prefix cache by hash. Raises RuntimeError("engine
        closed") if the engine is or gets closed.
        """
        if self._closed:
            raise RuntimeError("engine closed")
        sampling = sampling if sampling is not None else SamplingParams()
        error = request_error(
            prompt_ids, sampling, self.config.max_seq_len, self._runner.vocab_size
        )
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
        request = Request(
            request_id=request_id,
            prompt_ids=np.asarray(prompt_ids).astype(np.int64).tolist(),
            sampling=sampling,
            future=asyncio.get_running_loop().create_future(),
            generator=torch.Generator().manual_seed(sampling.seed),
            arrival_s=time.perf_counter(),
        )
        self._sched.waiting.append(request)
        self._wake.set()
        return await request.future

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Queues new weights (torchtitan names, full tensors); the loop pulls them in as
        its own action (see `EngineConfig.weight_sync_mode`). The engine keeps references
        to the tensors until they are applied, so do not modify them in the meantime."""
        if self._closed:
            raise RuntimeError("engine closed")
        self._pending_weights.append((state, version))
        if self._task is None:
            self._execute(Action(kind=ActionKind.PULL_WEIGHTS, version=version))
        else:
            self._wake.set()

    async def close(self) -> None:
        """Fails every outstanding request with RuntimeError("engine closed"), stops the
        loop."""
        if self._closed:
            return
        self._closed = True
        self._fail_all("engine closed")
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _ensure_loop(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        elif self._task.done():
            raise RuntimeError("engine loop stopped") from self._task.exception()

    async def _loop(self) -> None:
        try:
            while True:
                if not (self._sched.waiting or self._sched.running or self._pending_weights):
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
        if self._pending_weights and not (drain and self._sched.running):
            self._execute(
                Action(kind=ActionKind.PULL_WEIGHTS, version=self._pending_weights[-1][1])
            )
        if self._sched.waiting and not (drain and self._pending_weights):
            self._execute(Action(kind=ActionKind.ADMIT))
        if self._sched.running:
            self._execute(
                Action(kind=ActionKind.STEP, num_steps=self.config.max_steps_per_iteration)
            )

    def _execute(self, action: Action) -> None:
        if action.kind == ActionKind.PULL_WEIGHTS:
            self._pull_weights()
        elif action.kind == ActionKind.ADMIT:
            self._sched.admit(time.perf_counter())
        elif action.kind == ActionKind.STEP:
            assert action.num_steps is not None
            self._steps(action.num_steps)

    def _steps(self, num_steps: int) -> None:
        """Up to `num_steps` forwards over the running batch, each followed by sampling.

        Look-ahead (on by default on CUDA): once step n's sampling is queued on the device,
        step n+1's forward is queued too, fed with step n's tokens where they lie on the
        device, and only then does the host wait for step n's tokens, record them and
        resolve finished requests, while the device computes step n+1. A request that
        finished at step n (stop token, length, cancelled) got one extra row in step n+1:
        its sampled token is dropped, its key/value write landed in a block it owned and no
        one shares (the last, unfilled one), and the next step is prepared afresh without
        it. Tokens and generator draws of every kept row are those of stepping one at a
        time, log-probs too up to the rounding of a batch that still holds finished rows. No look-ahead past the last step of an iteration (weights and new
        requests come in between iterations), when a row wants its sampling support, or
        when the cache has no block to spare."""
        ahead: tuple[list[Request], torch.Tensor] | None = None
        for k in range(num_steps):
            if ahead is None:
                self._drop_cancelled()
                if not self._sched.running:
                    return
                batch = self._sched.prepare_step()  # may preempt: take the batch after
                requests = list(self._sched.running)
                logits_NV = self._runner.forward(batch)
                self._sched.step_done(requests)
            else:
                requests, logits_NV = ahead
            sampled = self._launch_sample(requests, logits_NV)
            ahead = None
            if k + 1 < num_steps and self._look_ahead and not sampled.support_wanted:
                if all(not r.future.done() for r in requests):
                    batch = self._sched.look_ahead_step(requests)
                    if batch is not None:
                        tokens = sampled.result.token_ids_N
                        ahead = (requests, self._runner.forward_decode(batch, tokens))
            self._record(requests, sampled)
            if ahead is not None:
                self._sched.step_done([r for r in requests if not r.future.done()])

    def _pull_weights(self) -> None:
        for state, version in self._pending_weights:
            self._runner.load_state_dict(state)
            self._version = version
        self._pending_weights.clear()
        self._sched.weights_changed(self._version, recompute=self.config.recompute_on_sync)

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._sched.running if r.future.done()]:
            self._sched.finish(request)

    def _launch_sample(self, requests: list[Request], logits_NV: torch.Tensor) -> _Sampled:
        """Queues the sampling of each request's next token and the copy of the results to
        the host; waits for the device only when a row wants its support."""
        if self._rows is None or self._rows.requests != requests:  # compares by identity
            self._rows = RowParams.of(requests, logits_NV.device)
        rows = self._rows
        out = sample_tokens(
            logits_NV,
            temperature_N=rows.temperature_N,
            top_p_N=rows.top_p_N,
            top_k_N=rows.top_k_N,
            generators=rows.generators,
            return_support=rows.return_support,
            plan=rows.plan,
        )
        if logits_NV.device.type != "cuda":
            return _Sampled(out, out.token_ids_N, out.logprobs_N, None, rows.return_support)
        token_ids_N = torch.empty(len(requests), dtype=torch.long, pin_memory=True)
        logprobs_N = torch.empty(len(requests), dtype=torch.float32, pin_memory=True)
        token_ids_N.copy_(out.token_ids_N, non_blocking=True)
        logprobs_N.copy_(out.logprobs_N, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Sampled(out, token_ids_N, logprobs_N, ready, rows.return_support)

    def _record(self, requests: list[Request], sampled: _Sampled) -> None:
        """Waits for a step's tokens, appends them, resolves the requests that finished.
        Rows of requests already finished or cancelled (a look-ahead step's) are skipped."""
        if sampled.ready is not None:
            sampled.ready.synchronize()
        out = sampled.result
        now = time.perf_counter()
        token_ids, logprobs = sampled.token_ids_N.tolist(), sampled.logprobs_N.tolist()
        live = [(i, r) for i, r in enumerate(requests) if not r.future.done()]
        for i, request in live:
            if not request.token_ids:
                request.first_token_s = now
            request.token_ids.append(token_ids[i])
            request.logprobs.append(logprobs[i])
            request.saw_version(self._version)
            if request.sampling.return_support:
                assert out.support is not None
                request.support.append(out.support[i].cpu().numpy())
        inflight = len(self._sched.running)
        for _, request in live:
            reason = self._finish_reason(request)
            if reason is not None:
                self._sched.finish(request)
                self._resolve(request, reason, now, inflight)

    def _finish_reason(self, request: Request) -> FinishReason | None:
        if request.token_ids[-1] in request.sampling.stop_token_ids:
            return FinishReason.STOP
        num_tokens = len(request.token_ids)
        if num_tokens >= request.sampling.max_tokens:
            return FinishReason.LENGTH
        if len(request.prompt_ids) + num_tokens >= self.config.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _resolve(self, request: Request, reason: FinishReason, now: float, inflight: int) -> None:
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
                "generator/prefix_hit_tokens": float(request.prefix_hit_tokens),
                "generator/preemptions": float(request.num_preemptions),
            },
        )
        if not request.future.done():
            request.future.set_result(completion)

    def _fail_all(self, message: str) -> None:
        for request in self._sched.drop_all():
            if not request.future.done():
                request.future.set_exception(RuntimeError(message))
