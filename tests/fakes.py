"""Test doubles: a byte-level chat renderer (tests/fake_renderer.py), a scripted GenerateFn,
scripted envs.
"""

from __future__ import annotations

import asyncio
import socket
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from fake_renderer import IM_END, IM_START, NEWLINE, FakeRenderer, encode  # noqa: F401
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs

from torchtitan_rl.envs.base import EnvConfig, Environment, MessageEnv, Rubric, StepResult
from torchtitan_rl.types import Completion, FinishReason, Message, Rollout, SamplingParams


def make_completion(
    token_ids: Sequence[int],
    *,
    request_id: str = "r",
    finish_reason: FinishReason = FinishReason.STOP,
    policy_version: int = 0,
    with_support: bool = False,
) -> Completion:
    """A completion whose log-prob at i is -(i + 1) / 100 and support at i is [id, id + 1]."""
    ids_N = np.asarray(token_ids, dtype=np.int32)
    n = ids_N.shape[0]
    completion = Completion(
        request_id=request_id,
        token_ids_N=ids_N,
        logprobs_N=-(np.arange(n, dtype=np.float32) + 1) / 100,
        finish_reason=finish_reason,
        policy_version_min=policy_version,
        policy_version_max=policy_version,
    )
    if with_support:
        completion.support_ids = np.stack([ids_N, ids_N + 1], axis=1).reshape(-1)
        completion.support_offsets = np.arange(0, 2 * n + 1, 2, dtype=np.int32)
    return completion


Response = Completion | str | None
"""What a script returns: a Completion, text (sampled as text + IM_END, STOP), or None."""


class MonarchLikeCall:
    """What a Monarch endpoint's `call_one` gives: awaitable, and observed through
    `as_asyncio()` (a fake generator actor's answer)."""

    def __init__(self, future: asyncio.Future):
        self.future = future

    def as_asyncio(self) -> asyncio.Future:
        return self.future

    def __await__(self):
        return self.future.__await__()


@dataclass(slots=True)
class GenerateCall:
    prompt_ids: np.ndarray
    request_id: str
    session_id: str | None
    sampling: SamplingParams | None


@dataclass(slots=True)
class ScriptedGenerate:
    """A GenerateFn answering from `respond(call)`; records every call.

    `jitter_s` sleeps a request-dependent time first, so requests finish out of order.
    """

    respond: Callable[[GenerateCall], Response]
    jitter_s: float = 0.0
    calls: list[GenerateCall] = field(default_factory=list)

    async def __call__(
        self,
        prompt_ids: np.ndarray,
        *,
        request_id: str,
        session_id: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> Completion | None:
        call = GenerateCall(np.asarray(prompt_ids).copy(), request_id, session_id, sampling)
        self.calls.append(call)
        if self.jitter_s:
            await asyncio.sleep(self.jitter_s * (zlib.crc32(request_id.encode()) % 7) / 7)
        response = self.respond(call)
        if isinstance(response, str):
            return make_completion([*encode(response), IM_END], request_id=request_id)
        return response


def always(text: str) -> ScriptedGenerate:
    return ScriptedGenerate(lambda call: text)


@dataclass(slots=True)
class Hang:
    """A script step that sleeps this long (to trip step_timeout_s)."""

    seconds: float


ScriptStep = StepResult | BaseException | Hang


class ScriptedEnv(MessageEnv):
    """Answers the k-th assistant message with script[k] (raise it if it is an exception)."""

    def __init__(self, script: Sequence[ScriptStep], *, first: str = "hi", init_error=None):
        self.script = list(script)
        self.first = first
        self.init_error = init_error
        self.received: list[str] = []

    async def init(self) -> list[Message]:
        if self.init_error is not None:
            raise self.init_error
        return [{"role": "user", "content": self.first}]

    async def step(self, assistant_message: str) -> StepResult:
        item = self.script[len(self.received)]
        self.received.append(assistant_message)
        if isinstance(item, Hang):
            await asyncio.sleep(item.seconds)
            raise AssertionError("the timeout should have cancelled this step")
        if isinstance(item, BaseException):
            raise item
        return item


def reply(text: str, *, done: bool = False, **signals: float) -> StepResult:
    return StepResult(
        messages=[{"role": "user", "content": text}], done=done, reward_signals=signals
    )


def done() -> StepResult:
    return StepResult(messages=[], done=True)


class FakeEnvironment(Environment):
    """Samples are {"index": i}; envs and rewards come from the given callables."""

    def __init__(
        self,
        make_env_fn: Callable[[dict[str, Any]], MessageEnv],
        reward_fn: Callable[[Rollout], float],
        *,
        config: EnvConfig | None = None,
    ):
        super().__init__(config or EnvConfig(), seed=0)
        self.make_env_fn = make_env_fn
        self.reward_fn = reward_fn

    def train_sample(self, index: int) -> dict[str, Any]:
        return {"index": index}

    def validation_samples(self, n: int) -> list[dict[str, Any]]:
        return [{"index": -1 - i} for i in range(n)]

    def make_env(self, sample: dict[str, Any]) -> MessageEnv:
        return self.make_env_fn(sample)

    def rubric(self) -> Rubric:
        return Rubric([("reward", self.reward_fn, 1.0)])

    def demonstration(self, sample: dict[str, Any]) -> list[Message]:
        return []


TRAINER_VOCAB = 96


def tiny_core(*, device: str = "cpu", seed: int = 0, loss=None, correction=None, **training):
    """A one-process TrainerCore of the tiny model (64 positions, vocabulary TRAINER_VOCAB),
    lr 1e-2 unless `training` says otherwise."""
    from torchtitan_rl.losses.corrections import CorrectionConfig
    from torchtitan_rl.losses.policy_loss import LossConfig
    from torchtitan_rl.models.qwen3 import ModelConfig
    from torchtitan_rl.training.trainer import TrainerCore
    from torchtitan_rl.training.trainer_config import TrainingConfig

    return TrainerCore(
        model_config=ModelConfig(max_seq_len=64),
        training=TrainingConfig(**{"lr": 1e-2, **training}),
        loss=loss or LossConfig(),
        correction=correction or CorrectionConfig(),
        vocab_size=TRAINER_VOCAB,
        device=torch.device(device),
        seed=seed,
    )


def tiny_qwen3(seed: int = 0, vocab: int = 97, n_layers: int = 2) -> Qwen3Model:
    """A 2-layer (or `n_layers`) random Qwen3 for engine and runner tests (fp32, untied)."""
    torch.manual_seed(seed)
    args = Qwen3ModelArgs(
        dim=64,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=128,
        vocab_size=vocab,
        max_seq_len=64,
        enable_weight_tying=False,
    )
    model = Qwen3Model(args)
    with torch.no_grad():
        model.init_weights()
    return model


def free_ports(n: int) -> int:
    """First of n consecutive free TCP ports on 127.0.0.1 (one rendezvous each)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        try:
            for p in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
    raise RuntimeError("no free ports")


def run_two_ranks(worker: Callable, *args, ports: int = 1, timeout: float = 600) -> dict:
    """Runs `worker(rank, first_port, *args, queue)` in two spawned processes; returns
    {rank: what it put on the queue}, failing with the traceback a rank put there instead
    (a worker catches its exception and puts `traceback.format_exc()`)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_ports(ports)
    procs = [ctx.Process(target=worker, args=(r, port, *args, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, r in results.items():
        assert not isinstance(r, str), f"rank {rank}:\n{r}"
    return results


async def run_until_a_kill_ends_it(controller, kill, kill_within_s=600.0) -> tuple[str, float]:
    """Run `controller` while the coroutine `kill()` kills a process (it returns the
    perf_counter time of the kill); the run must end with ActorFailure. Returns (its one
    line, seconds from the kill to it); the controller is closed either way. What does not
    arrive fails the test with one line: the kill (within `kill_within_s`: the run's own
    steps are bounded, a loaded machine only slows them), or the failure after it (within
    the longest the supervision may wait for Monarch's reports, derived from its settings)."""
    import time

    import pytest

    from torchtitan_rl.controller import supervision
    from torchtitan_rl.controller.supervision import ActorFailure

    killer, run = asyncio.ensure_future(kill()), asyncio.ensure_future(controller.run())
    try:
        await asyncio.wait({killer, run}, timeout=kill_within_s, return_when="FIRST_COMPLETED")
        if not killer.done():
            ended = "ended" if run.done() else f"was {controller.supervisor.where}"
            pytest.fail(f"the kill did not happen within {kill_within_s:g} s: the run {ended}")
        sync = controller.fleet.weight_sync
        failure_within_s = (
            controller.config.launcher.host_timeout_s + 10.0  # Monarch notices the death
            + supervision.PEER_REPORT_WAIT_S + supervision.NAMED_REPORT_WAIT_S
            + supervision.FAILURE_GRACE_S + (sync.peer_failure_wait_s if sync else 0.0)
        )  # fmt: skip
        await asyncio.wait({run}, timeout=failure_within_s)
        if not run.done():
            pytest.fail(
                f"no failure within {failure_within_s:.0f} s of the kill: the run was "
                f"{controller.supervisor.where}"
            )
        with pytest.raises(ActorFailure) as failure:
            await run
        return str(failure.value), time.perf_counter() - await killer
    finally:
        killer.cancel()
        run.cancel()
        await controller.close()
