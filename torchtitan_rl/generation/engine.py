"""The native generation engine: continuous batching over a paged KV cache.

Its asyncio front (submit, queue, the pull -> admit -> steps loop, close) is the seam's
`EngineFront` (generation/front.py); this module supplies the verbs: admitting from the
scheduler's queue, stepping the running batch (`_steps`), applying weights.

A request's token at position p (its index in the completion) draws the uniform
U(`SamplingParams.seed`, p) of `keyed_random`: no generator state, so its tokens do not
depend on what else is in the batch, when it was admitted, or whether it was preempted,
recomputed or given a look-ahead row that was dropped. The rows' settings and draws are
kept from step to step and updated by what changed (`SamplingRows`).

No Monarch import here: the generator actor is a thin adapter around this class.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import torch
from torchtitan.models.qwen3 import Qwen3Model

from torchtitan_rl.device import DTYPES, to_device_async
from torchtitan_rl.generation.block_manager import BlockManager
from torchtitan_rl.generation.cuda_graphs import LONG_PREFILL, DecodeGraphs, MixedGraphs
from torchtitan_rl.generation.front import EngineFront
from torchtitan_rl.generation.interface import AdapterUse, EngineConfig
from torchtitan_rl.generation.model_runner import ModelRunner
from torchtitan_rl.generation.sampling import SampleResult, sample_tokens
from torchtitan_rl.generation.sampling_rows import SamplingRows
from torchtitan_rl.generation.scheduler import Request, Scheduler
from torchtitan_rl.types import Completion, FinishReason, SamplingParams


@dataclass(slots=True)
class _Sampled:
    """A step's sampling as queued on the device: `token_ids_N` / `logprobs_N` are host
    copies (on CUDA: views of the engine's pinned buffers) that are valid once `ready`
    (None: already) has passed; `positions`: each row's position, the index in its
    completion of the token it samples (its draw's key)."""

    result: SampleResult
    token_ids_N: torch.Tensor
    logprobs_N: torch.Tensor
    ready: torch.cuda.Event | None
    support_wanted: bool
    positions: list[int]


def build_native_engine(
    model, config: EngineConfig, vocab_size: int, device, hf_folder: str, lora=None
):
    """The `generator.backend = "native"` factory (generation/backends.py): an `Engine` over
    a freshly built policy model (`model`: a `ModelConfig`); its weights arrive by the first
    sync, so `hf_folder` is unused, and with [lora] it merges each version's adapters into
    them (`AdapterUse.MERGE`: the same for any `lora`). Built in the engine's dtype (no fp32 copy of the whole
    model on the device at any time)."""
    from torchtitan_rl.models.qwen3 import build_model

    return Engine(build_model(model, vocab_size, device, DTYPES[config.dtype]), config, device)


class Engine(EngineFront):
    """Continuous-batching generation on one device (see the module docstring).

    Call every method from the event loop thread the engine runs on.
    """

    adapter_use = AdapterUse.MERGE
    """[lora]: the generator merges each version's adapters into the weights it loads here
    (merged weights cost nothing per token; docs/benchmarks.md, "Adapter-only weight
    sync")."""

    def __init__(
        self,
        model: Qwen3Model,
        config: EngineConfig,
        device: torch.device | str = "cpu",
        *,
        look_ahead: bool | None = None,
        threaded: bool = True,
        steps_per_yield: int = 8,
    ) -> None:
        """`look_ahead`: queue each forward before reading the previous step's tokens
        (`_steps`); None: on CUDA, where it keeps the device busy while the host records
        tokens. On CPU it only adds a wasted row per finished request (tests turn it on
        there to check it changes no result). `threaded`, `steps_per_yield`: the front's
        driver (generation/front.py)."""
        config = config.for_device(torch.device(device).type)
        super().__init__(config, threaded=threaded, steps_per_yield=steps_per_yield)
        self._runner = ModelRunner(
            model,
            num_blocks=config.total_blocks(),
            block_size=config.block_size,
            max_seq_len=config.max_seq_len,
            device=device,
            dtype=DTYPES[config.dtype],
            decode_attention=config.decode_attention,
            batch_invariant=config.batch_invariant,
        )
        self.vocab_size = self._runner.vocab_size
        if config.cuda_graphs and self._runner.device.type == "cuda":
            self._runner.decode_graphs = DecodeGraphs(self._runner, max_batch=config.max_num_seqs)
            if self._runner.decode_attention == "triton":
                self._runner.mixed_graphs = MixedGraphs(self._runner, max_rows=config.max_num_seqs)
        blocks = BlockManager(
            config.total_blocks(),
            config.block_size,
            enable_prefix_cache=config.enable_prefix_cache,
        )
        self._sched = Scheduler(blocks, max_num_seqs=config.max_num_seqs)
        self._look_ahead = self._runner.device.type == "cuda" if look_ahead is None else look_ahead
        self._rows = SamplingRows(config.max_num_seqs, self._runner.device)
        """The sampler's inputs for the step's rows, updated by what changed."""
        self._host_out: tuple[torch.Tensor, torch.Tensor] | None = None
        """CUDA: pinned host buffers for a step's tokens and log-probs, and the event marking
        their copy done, allocated once and reused by every step: `_step` queues step k+1's
        copy only after `_record` has read step k's (`_unread` checks it)."""
        self._ready: torch.cuda.Event | None = None
        self._unread = False
        self._ahead: tuple[list[Request], torch.Tensor, int] | None = None
        """The step in flight: its rows, its logits (being computed), its weights version."""
        self.stats = {"steps": 0, "drained_steps": 0, "prefill_rows_joined": 0}
        """Counters since start: engine steps; those started with no step in flight (the
        device idles while the host builds them); requests whose prefill joined a step
        queued ahead."""

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    def model_parameters(self):
        """(name, tensor) of the model this engine runs, by our names (tied ones repeated)."""
        return self.runner.model.named_parameters(remove_duplicate=False)

    # ---- the verbs the front's loop calls (generation/interface.py) ----------------------
    def _enqueue(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        future: asyncio.Future,
        arrival_s: float,
    ) -> None:
        # `_finish_reason`'s length limits as the last position before them
        limit = min(sampling.max_tokens, self.config.max_seq_len - len(prompt_ids))
        self._sched.waiting.append(
            Request(
                request_id=request_id,
                prompt_ids=prompt_ids,
                sampling=sampling,
                future=future,
                arrival_s=arrival_s,
                arrival_step=self.stats["steps"],
                check_from=0 if sampling.stop_sequences else limit - 1,
            )
        )

    def _has_waiting(self) -> bool:
        return bool(self._sched.waiting)

    def _has_running(self) -> bool:
        return bool(self._sched.running)

    def _has_started(self) -> bool:
        return bool(self._sched.running) or any(r.token_ids for r in self._sched.waiting)

    def _admit(self, started_only: bool = False) -> None:
        """Admits what fits; with mixed-step graphs, no more short prefill tokens than the
        largest graph holds beside the running rows, so the step stays a graph replay (the
        rest joins the next steps); long prompts come in at once (their step is eager)."""
        graphs = self._runner.mixed_graphs
        budget = None if graphs is None else graphs.buckets[-1] - len(self._sched.running)
        self._sched.admit(
            time.perf_counter(),
            max_new_tokens=budget,
            started_only=started_only,
            long_prefill=LONG_PREFILL,
        )

    def _drop_all(self) -> list[asyncio.Future]:
        self._ahead = None
        self._unread = False
        return [request.future for request in self._sched.drop_all()]

    def _steps(self, num_steps: int) -> None:
        """Up to `num_steps` forwards over the running batch, each followed by sampling.

        Look-ahead (on by default on CUDA): once step k's sampling is queued on the device,
        step k+1's forward is queued too, and only then does the host wait for step k's
        tokens, record them and resolve finished requests, while the device computes step
        k+1. Step k+1 holds every row of step k not already over, fed with its token where
        it lies on the device, plus the prefill of every request admitted since (its
        prompt from the host). A request that finished at step k (stop token, length,
        cancelled) got one extra row in step k+1: its sampled token is dropped, its
        key/value write landed in a block it owned and no one shares (the last, unfilled
        one). Tokens and random draws (keyed by position) of every kept row are those of
        stepping one at a time, log-probs too up to the rounding of a batch that still holds
        finished rows.

        The step in flight outlives this call: new requests and the next call join it
        (nothing drains between calls). It is finished first before weights are pulled,
        and not started when a row wants its sampling support or the cache has no block
        to spare."""
        for _ in range(num_steps):  # a step in flight always holds a running row
            if not self._sched.running:
                return
            self._step(look_ahead=self._look_ahead)

    def _step(self, *, look_ahead: bool) -> None:
        if self._ahead is None:
            self._drop_cancelled()
            if not self._sched.running:
                return
            batch = self._sched.prepare_step()  # may preempt: take the batch after
            requests = list(self._sched.running)
            logits_NV = self._runner.forward(batch)
            self._sched.step_done(requests)
            version = self._version
            self.stats["drained_steps"] += 1
        else:
            requests, logits_NV, version = self._ahead
            self._ahead = None
        self.stats["steps"] += 1
        sampled = self._launch_sample(requests, logits_NV)
        if look_ahead and not sampled.support_wanted:
            self._ahead = self._launch_look_ahead(requests, sampled)
        self._record(requests, sampled, version)
        if self._ahead is not None:
            live = [r for r in self._ahead[0] if not r.is_over()]
            self._sched.step_done(live)
            if not live:  # every row finished: nothing to keep in flight
                self._ahead = None

    def _launch_look_ahead(self, requests: list[Request], sampled: _Sampled):
        """Queues the forward of the step after `requests`' (see `_steps`): its rows, logits
        and weights version; None when the cache has no block to spare."""
        # Read once: the caller's loop may cancel a row meanwhile, and a row left out of
        # the step must be finished, else it stays running outside the step in flight.
        over = [r.is_over() for r in requests]
        for request, is_over in zip(requests, over):
            if is_over and not request.finished:  # cancelled while in flight
                self._sched.finish(request)
        keep = [i for i, is_over in enumerate(over) if not is_over]
        continuing = [requests[i] for i in keep]
        in_step = {id(r) for r in requests}
        admitted = [r for r in self._sched.running if id(r) not in in_step]
        if not continuing and not admitted:
            return None
        inputs = self._sched.look_ahead_step(continuing, admitted)
        if inputs is None:
            return None
        tokens_N = sampled.result.token_ids_N
        if len(keep) < len(requests):
            tokens_N = tokens_N[to_device_async(torch.tensor(keep), tokens_N.device)]
        logits_NV = self._runner.forward_look_ahead(*inputs, tokens_N[: len(continuing)])
        self.stats["prefill_rows_joined"] += len(admitted)
        return continuing + admitted, logits_NV, self._version

    def _flush(self) -> None:
        """Finishes the step in flight, starting no other."""
        if self._ahead is not None:
            self._step(look_ahead=False)

    def _pull_weights(self, pending) -> None:
        self._flush()  # its forward ran under the weights it was queued with
        for state, version, partial in pending:
            self._runner.load_state_dict(state, partial=partial)
            self._version = version
        self._sched.weights_changed(self._version, recompute=self.config.recompute_on_sync)

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._sched.running if r.future.done()]:
            self._sched.finish(request)

    def _launch_sample(self, requests: list[Request], logits_NV: torch.Tensor) -> _Sampled:
        """Queues the sampling of each request's next token and the copy of the results to
        the host; waits for the device only when a row wants its support."""
        cuda = logits_NV.device.type == "cuda"
        # Also guards the rows' host buffer: the last step's copy from it ran before its
        # results, which the host has read.
        assert not (cuda and self._unread), "a step's host buffers are reused before they were read"
        rows = self._rows
        rows.update(requests)
        out = sample_tokens(
            logits_NV, **rows.sampler_args(), invariant=self._runner.batch_invariant
        )
        positions = rows.positions()
        if not cuda:
            return _Sampled(
                out, out.token_ids_N, out.logprobs_N, None, rows.return_support, positions
            )
        N = len(requests)
        if self._host_out is None or self._host_out[0].numel() < N:
            size = max(N, self.config.max_num_seqs)
            self._host_out = (
                torch.empty(size, dtype=torch.long, pin_memory=True),
                torch.empty(size, dtype=torch.float32, pin_memory=True),
            )
            self._ready = torch.cuda.Event()
        self._unread = True
        token_ids_N, logprobs_N = (buffer[:N] for buffer in self._host_out)
        token_ids_N.copy_(out.token_ids_N, non_blocking=True)
        logprobs_N.copy_(out.logprobs_N, non_blocking=True)
        self._ready.record()
        return _Sampled(out, token_ids_N, logprobs_N, self._ready, rows.return_support, positions)

    def _record(self, requests: list[Request], sampled: _Sampled, version: int) -> None:
        """Waits for a step's tokens (computed under weights `version`), appends them,
        resolves the requests that finished. Rows of requests already over (a look-ahead
        step's) are skipped.

        The results come to the host in one conversion each; per row only the appends and
        two comparisons run (`Request.check_from`: the full finish check only where a
        length limit or a stop sequence may end it). Each row's position must be its token
        count: `SamplingRows` moves a kept row's on by one per step, which holds only if
        every live row records exactly one token per step; if not, its draws would be
        keyed off by one from then on (asserted here)."""
        if sampled.ready is not None:
            sampled.ready.synchronize()
        now = time.perf_counter()
        token_ids, logprobs = sampled.token_ids_N.tolist(), sampled.logprobs_N.tolist()
        self._unread = False  # read: the next step may reuse the host buffers
        if sampled.support_wanted:
            _record_support(requests, sampled.result)
        step = self.stats["steps"]
        ending = []
        for request, token, logprob, position in zip(
            requests, token_ids, logprobs, sampled.positions
        ):
            if request.finished or request.future.done():  # `is_over`, inlined
                continue
            ids = request.token_ids
            assert len(ids) == position, (
                f"request {request.request_id} sampled at position {position} with "
                f"{len(ids)} tokens: a draw is keyed by its token's index (SamplingRows)"
            )
            if not position:
                request.first_token_s = now
                request.first_step = step
            ids.append(token)
            request.logprobs.append(logprob)
            if version != request.version_max or request.version_min is None:
                request.saw_version(version)  # rarely: once per request and weights version
            if position >= request.check_from or token in request.sampling.stop_token_ids:
                ending.append(request)
        inflight = len(self._sched.running)
        for request in ending:
            reason = self._finish_reason(request)
            if reason is not None:
                self._sched.finish(request)
                self._resolve(request, reason, now, inflight)

    def _finish_reason(self, request: Request) -> FinishReason | None:
        ids = request.token_ids
        if ids[-1] in request.sampling.stop_token_ids:
            return FinishReason.STOP
        for seq in request.sampling.stop_sequences:
            if len(ids) >= len(seq) and tuple(ids[-len(seq) :]) == seq:
                return FinishReason.STOP
        if len(ids) >= request.sampling.max_tokens:
            return FinishReason.LENGTH
        if len(request.prompt_ids) + len(ids) >= self.config.max_seq_len:
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
                "generator/steps_to_first_token": float(request.first_step - request.arrival_step),
                "generator/time_to_first_token_ms": 1e3
                * (request.first_token_s - request.arrival_s),
                "generator/decode_time_ms": 1e3 * (now - request.first_token_s),
                "generator/inflight_at_completion": float(inflight),
                "generator/prefix_hit_tokens": float(request.prefix_hit_tokens),
                "generator/preemptions": float(request.num_preemptions),
            },
        )
        self._complete(request.future, completion)


def _record_support(requests: list[Request], result: SampleResult) -> None:
    """Appends each live row's sampling support to its request, if it asked for it: one
    copy to the host for the step (a `.cpu()` per row would wait for the device per row)."""
    rows = [i for i, r in enumerate(requests) if r.sampling.return_support and not r.is_over()]
    if not rows:
        return
    assert result.support is not None
    support = [result.support[i] for i in rows]
    ids = torch.cat(support).cpu().numpy()
    ends = np.cumsum([len(s) for s in support[:-1]])
    for i, kept in zip(rows, np.split(ids, ends)):
        requests[i].support.append(kept)
