"""Records that cross process and module boundaries.

Per-token arrays are numpy (int32 ids, float32 log-probs, bool masks), never Python lists,
so they pickle compactly through Monarch. Shape suffixes: N = completion tokens of one
turn, L = tokens of one episode, R = rows of a batch, S = sequence length of a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

import numpy as np

from torchtitan_rl.checks import check_range

Message = dict[str, str]
"""One chat message: {"role": "system" | "user" | "assistant", "content": str}."""


class FinishReason(StrEnum):
    STOP = "stop"  # sampled a stop token (kept as the last token)
    LENGTH = "length"  # hit max_tokens or the context limit
    ABORT = "abort"  # cancelled by the engine (drain, close)
    ERROR = "error"  # the request itself was invalid; see Completion.error


class RolloutStatus(StrEnum):
    COMPLETED = "completed"
    TRUNCATED_LENGTH = "truncated_length"  # a completion hit max_tokens
    TRUNCATED_PROMPT = "truncated_prompt"  # the next prompt would exceed the token budget
    TRUNCATED_TURNS = "truncated_turns"  # env.max_turns reached before the env said done
    ERROR_PARSE = "error_parse"
    ERROR_TIMEOUT = "error_timeout"
    ERROR_ENV = "error_env"
    ERROR_GENERATOR = "error_generator"
    ERROR_REWARD = "error_reward"

    def is_error(self) -> bool:
        return self.value.startswith("error")

    def is_truncated(self) -> bool:
        return self.value.startswith("truncated")


MIN_TEMPERATURE = 1e-4
"""The smallest temperature above 0 (greedy): past it a logit divided by it can overflow."""
MAX_TOP_K = 2**31 - 1
"""top_k's bound (the sampler holds it in int32-sized tensors; any vocabulary is smaller)."""


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy."""

    temperature: float = 1.0
    """Finite and >= 0."""
    top_p: float = 1.0
    """Nucleus mass kept, in (0, 1]; 1 disables."""
    top_k: int = 0
    """Number of most likely tokens kept; 0 disables."""
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token-id sequences that end the request once its generated ids end with one (kept in
    the completion, as a stop token is); finish reason STOP."""
    seed: int = 0
    """Keys this request's random draws (native engine: the uniform U(seed, position) of
    generation/keyed_random.py; vLLM: its per-request generator), so results do not depend
    on batching order."""
    return_support: bool = False
    """Record the token ids kept by top-p/top-k at each position (for mask replay)."""

    def __reduce__(self) -> tuple:  # see _sampling
        return _sampling, tuple(getattr(self, name) for name in _SAMPLING_FIELDS)

    def validate(self) -> None:
        check_range("temperature", self.temperature, ge=0)
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / t would overflow float32
            raise ValueError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}"
            )
        check_range("top_p", self.top_p, gt=0, le=1)
        check_range("top_k", self.top_k, ge=0, le=MAX_TOP_K)
        check_range("max_tokens", self.max_tokens, ge=1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int | np.integer):
            raise ValueError(
                f"seed must be an integer, got {type(self.seed).__name__} {self.seed!r}"
            )


_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


@dataclass(kw_only=True, slots=True)
class Completion:
    """One generated turn.

    `logprobs_N[i]` is log p(token_ids_N[i] | prefix) under the distribution the token was
    sampled from: the policy's logits divided by the temperature, renormalised over the
    top-p/top-k support when those are active (greedy: temperature 1, full vocabulary).
    With return_support, the kept ids at position i are
    `support_ids[support_offsets[i]:support_offsets[i + 1]]` (CSR).
    """

    request_id: str
    token_ids_N: np.ndarray  # int32
    logprobs_N: np.ndarray  # float32
    finish_reason: FinishReason
    policy_version_min: int = 0
    policy_version_max: int = 0
    error: str | None = None
    support_ids: np.ndarray | None = None  # int32 [sum of kept]
    support_offsets: np.ndarray | None = None  # int32 [N + 1]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids_N.shape[0])

    def __reduce__(self) -> tuple:  # see _completion
        arrays = (self.token_ids_N, self.logprobs_N, self.support_ids, self.support_offsets)
        rest = (self.request_id, self.finish_reason.value, self.policy_version_min,
                self.policy_version_max, self.error, self.metrics)  # fmt: skip
        return _completion, (*(_wire(a) for a in arrays), *rest)


# A Completion crosses Monarch once per turn and SamplingParams with each generate call, on
# the controller's one thread: pickled as tuples with their arrays as bytes (not numpy's own
# reduce per array, nor a dataclass's state), a turn's message costs the controller 18 us
# instead of 34-39, and the generator 10-12 instead of 36-45 (docs/benchmarks.md, "The
# generate call's message").


def _wire(a: np.ndarray | None) -> tuple | None:
    """A 1-D array as (dtype, bytes); anything else (another shape, which bytes would
    flatten, or not an array) as (itself,), pickled as it was before."""
    if a is None:
        return None
    if type(a) is np.ndarray and a.ndim == 1 and not a.dtype.hasobject:
        return a.dtype.str, a.tobytes()  # C order, whatever the strides
    return (a,)


def _unwire(w: tuple | None) -> np.ndarray | None:
    if w is None:
        return None
    if len(w) == 1:
        return w[0]
    return np.frombuffer(bytearray(w[1]), np.dtype(w[0]))


def _completion(tokens, logprobs, support_ids, support_offsets, *rest) -> Completion:
    request_id, finish, version_min, version_max, error, metrics = rest
    return Completion(
        request_id=request_id,
        token_ids_N=_unwire(tokens),
        logprobs_N=_unwire(logprobs),
        finish_reason=FinishReason(finish),
        policy_version_min=version_min,
        policy_version_max=version_max,
        error=error,
        support_ids=_unwire(support_ids),
        support_offsets=_unwire(support_offsets),
        metrics=metrics,
    )


def _sampling(*values: Any) -> SamplingParams:
    return SamplingParams(**dict(zip(_SAMPLING_FIELDS, values, strict=True)))


_INT32 = np.dtype(np.int32)


def ids_to_wire(ids: np.ndarray) -> bytes | np.ndarray:
    """Token ids as the bytes of an int32 array: how a generate call sends its prompt (a
    numpy array's own pickle costs ~25 us more through Monarch). Only a 1-D integer array
    whose values int32 holds goes as bytes; anything else goes as is, for the generator to
    answer with its ERROR completion (a cast would flatten a 2-D prompt, truncate floats
    and wrap an id of 2**32 + 5 to 5, a valid token)."""
    if type(ids) is not np.ndarray or ids.ndim != 1:
        return ids
    if ids.dtype is _INT32:
        return ids.tobytes()  # C order, whatever the strides
    if ids.dtype.kind in "iu" and (ids.size == 0 or (ids.min() >= -(2**31) and ids.max() < 2**31)):
        return ids.astype(np.int32).tobytes()
    return ids


def ids_from_wire(ids: np.ndarray | bytes) -> np.ndarray:
    """The int32 ids `ids_to_wire` sent, writable; what it sent as is comes back as is."""
    return np.frombuffer(bytearray(ids), np.int32) if isinstance(ids, bytes) else ids


class GenerateFn(Protocol):
    """What the Rollouter calls for one turn; None means the generator is gone."""

    async def __call__(
        self,
        prompt_ids: np.ndarray,
        *,
        request_id: str,
        session_id: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> Completion | None: ...


@runtime_checkable
class EndsSessions(Protocol):
    """A GenerateFn that keeps state per session (the Router's replica affinity). The
    Rollouter calls `end_session` once the rollout of that session has ended (done, errored
    or cancelled), so the state lives exactly as long as the rollout."""

    def end_session(self, session_id: str) -> None: ...


@dataclass(kw_only=True, slots=True)
class RolloutTurn:
    """One assistant turn: the full prompt it saw (token ids), what it sampled, the env's reply."""

    prompt_ids: np.ndarray  # int32, everything before the completion
    completion: Completion
    assistant_text: str
    env_messages: list[Message] = field(default_factory=list)
    reward_signals: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class Rollout:
    group_id: int
    rollout_id: int
    session_id: str
    sample: dict[str, Any]
    """The env sample (e.g. names per turn) this rollout was played on."""
    messages: list[Message] = field(default_factory=list)
    turns: list[RolloutTurn] = field(default_factory=list)
    status: RolloutStatus = RolloutStatus.COMPLETED
    error: str | None = None
    """One line: why the rollout errored (its status says how)."""
    error_details: str | None = None
    """The traceback, when user code (env, reward function) raised."""
    reward: float = 0.0
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    advantage: float = 0.0
    scorer_error: str | None = None
    """One line, when a rubric function raised `envs.base.WrongAnswer` (a hub dataset's scorer
    on a malformed reply): it scored 0 there and the rollout trains, counted in
    rollout/scorer_raised. E.g. "score_answer: ValueError: invalid literal for int() ..."."""


@dataclass(kw_only=True, slots=True)
class RolloutGroup:
    group_id: int
    rollouts: list[Rollout]
    sample_index: int | None = None
    """The training prompt's dataset index (None for validation and test groups)."""


def every_rollout_errored(groups: list[RolloutGroup]) -> bool:
    """Whether `groups` hold rollouts and every one of them errored: then the error lines,
    not a lack of reward spread, say why a step trains on nothing."""
    statuses = [r.status for g in groups for r in g.rollouts]
    return bool(statuses) and all(s.is_error() for s in statuses)


@dataclass(kw_only=True, slots=True)
class Episode:
    """One packed token sequence for one rollout branch.

    For a 2-turn rollout with prompt P0, completion A0, env reply E0, completion A1:
        token_ids_L      = P0 + A0 + E0 + A1
        loss_mask_L      = [0]*len(P0) + [1]*len(A0) + [0]*len(E0) + [1]*len(A1)
        logprobs_L       = generator log-probs on A0/A1 tokens, 0 elsewhere
        advantages_L     = the rollout advantage on A0/A1 tokens, 0 elsewhere
    The label of position t is token_ids_L[t + 1]; the batcher does the shift.
    """

    token_ids_L: np.ndarray  # int32
    loss_mask_L: np.ndarray  # bool
    logprobs_L: np.ndarray  # float32
    advantages_L: np.ndarray  # float32
    group_id: int = 0
    rollout_id: int = 0
    branch: int = 0
    policy_version_min: int = 0
    policy_version_max: int = 0
    support_ids: np.ndarray | None = None  # int32 CSR over loss-mask positions, in order
    support_offsets: np.ndarray | None = None  # int32 [num loss tokens + 1]

    def __len__(self) -> int:
        return int(self.token_ids_L.shape[0])


@dataclass(kw_only=True, slots=True)
class Microbatch:
    """Packed rows for one forward/backward on one data-parallel rank.

    Documents (episodes) sit side by side in a row; attention never crosses documents
    (`document_ids_RS`, -1 on padding) and positions restart at 0 for every document.
    `labels_RS[r, t]` is the token after `input_ids_RS[r, t]`; the per-token arrays below are
    aligned with labels: `loss_mask_RS[r, t]` says whether label t is trained on.
    `sequence_ids_RS` numbers episodes within the whole step (-1 on padding and on a prefix
    tree's shared prefix, whose labels are never trained; see `branch_ids_RS`) for
    sequence-level losses. `num_global_loss_tokens` counts loss tokens over all ranks
    and microbatches of the step (token-mean denominator).
    """

    input_ids_RS: np.ndarray  # int32
    labels_RS: np.ndarray  # int32
    positions_RS: np.ndarray  # int32
    document_ids_RS: np.ndarray  # int32
    loss_mask_RS: np.ndarray  # bool
    logprobs_RS: np.ndarray  # float32, generator log-prob of the label
    advantages_RS: np.ndarray  # float32
    sequence_ids_RS: np.ndarray  # int32
    num_global_loss_tokens: int
    num_global_sequences: int
    support_ids: np.ndarray | None = None  # int32 CSR over loss tokens in row-major order
    support_offsets: np.ndarray | None = None
    branch_ids_RS: np.ndarray | None = None
    """int32, set when a document is a prefix tree: 0 on its shared prefix (and on every
    plain document), k >= 1 on its k-th continuation; None = all 0."""
