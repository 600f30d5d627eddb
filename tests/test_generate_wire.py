"""The generate call's message: a Completion and SamplingParams pickle as tuples with their
arrays as bytes (numpy's own reduce and a dataclass's state cost the controller's one thread
~30-45 us a turn through Monarch), and come back equal to the bit."""

import asyncio
import pickle

import numpy as np
import pytest
from fakes import MonarchLikeCall
from monarch._rust_bindings.monarch_hyperactor.pickle import pickle as monarch_pickle

from torchtitan_rl.actors.generate_fn import ActorGenerateFn
from torchtitan_rl.types import (
    Completion,
    FinishReason,
    SamplingParams,
    ids_from_wire,
    ids_to_wire,
)


def _completions() -> list[Completion]:
    rng = np.random.default_rng(0)
    lp = rng.standard_normal(5).astype(np.float32)
    lp[1] = -np.inf  # a token outside the support of the policy that scored it
    lp[2] = np.float32(-0.0)
    return [
        Completion(
            request_id="3/0/1/2",
            token_ids_N=np.array([7, 2**31 - 1, 0, -1, 5], np.int32),
            logprobs_N=lp,
            finish_reason=FinishReason.STOP,
            policy_version_min=4,
            policy_version_max=5,
            support_ids=np.arange(9, dtype=np.int32),
            support_offsets=np.array([0, 2, 4, 6, 8, 9], np.int32),
            metrics={"time_to_first_token_ms": 1.5, "decode_time_ms": 2.25},
        ),  # fmt: skip
        Completion(
            request_id="x",
            token_ids_N=np.zeros(0, np.int32),
            logprobs_N=np.zeros(0, np.float32),
            finish_reason=FinishReason.ERROR,
            error="temperature must be 0 or >= 0.0001",
        ),  # fmt: skip
        Completion(  # another dtype than documented comes back as it went
            request_id="y",
            token_ids_N=np.arange(3, dtype=np.int64),
            logprobs_N=np.array([-0.5, -1.0, -2.0]),
            finish_reason=FinishReason.LENGTH,
        ),  # fmt: skip
    ]


def _assert_same(got: Completion, want: Completion) -> None:
    for name in Completion.__slots__:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.tobytes() == b.tobytes(), name
            assert a.flags.writeable, name
        else:
            assert a == b and type(a) is type(b), name


@pytest.mark.parametrize("load", ["pickle", "monarch"])
def test_a_completion_comes_back_bit_for_bit(load):
    for c in _completions():
        got = pickle.loads(pickle.dumps(c)) if load == "pickle" else monarch_pickle(c).unpickle()
        _assert_same(got, c)


def test_a_completion_and_sampling_params_carry_no_numpy_array_or_state_dict():
    c = _completions()[0]
    assert b"_reconstruct" not in pickle.dumps(c)  # numpy's array reduce
    s = SamplingParams(temperature=0.6, top_p=0.9, top_k=20, max_tokens=128, seed=-(2**63),
                       stop_token_ids=(151645, 151643), stop_sequences=((1, 2), (3,)),
                       return_support=True)  # fmt: skip
    assert b"__setstate__" not in pickle.dumps(s) and b"temperature" not in pickle.dumps(s)
    for got in (pickle.loads(pickle.dumps(s)), monarch_pickle(((s,), {})).unpickle()[0][0]):
        assert got == s


def test_prompt_ids_cross_as_int32_bytes():
    ids = np.array([0, 5, 2**31 - 1], np.int64)
    wire = ids_to_wire(ids)
    assert isinstance(wire, bytes) and len(wire) == 12
    back = ids_from_wire(wire)
    assert back.dtype == np.int32 and back.tolist() == ids.tolist() and back.flags.writeable
    same = np.arange(3, dtype=np.int32)
    assert ids_from_wire(same) is same


def test_actor_generate_fn_sends_the_prompt_as_bytes():
    sent = []

    class Actor:
        def __init__(self):
            self.generate = self

        def call_one(self, prompt_ids, request_id, session_id, sampling):
            sent.append(prompt_ids)
            future = asyncio.get_running_loop().create_future()
            future.set_result(_completions()[0])
            return MonarchLikeCall(future)

    prompt = np.array([11, 12, 13], np.int32)
    got = asyncio.run(ActorGenerateFn(Actor())(prompt, request_id="r"))
    assert got.request_id == "3/0/1/2"
    assert isinstance(sent[0], bytes) and ids_from_wire(sent[0]).tolist() == [11, 12, 13]


def test_a_completion_array_of_any_layout_comes_back_as_it_went():
    ids = np.arange(12, dtype=np.int32)
    lp = np.linspace(-3, 0, 12).astype(">f4")  # big-endian stays big-endian
    views = [ids[::3], np.asfortranarray(ids.reshape(3, 4))[:, 1], ids.reshape(3, 4)]
    for tokens in [*views, np.array(7, np.int32), [1, 2], np.array([None], object)]:
        c = Completion(request_id="r", token_ids_N=tokens, logprobs_N=lp[::2],
                       finish_reason=FinishReason.STOP)  # fmt: skip
        for got in (pickle.loads(pickle.dumps(c)), monarch_pickle(c).unpickle()):
            back, back_lp = got.token_ids_N, got.logprobs_N
            assert type(back) is type(tokens) and np.shape(back) == np.shape(tokens)
            assert np.array_equal(back, tokens)
            assert back_lp.dtype.str == ">f4" and back_lp.tobytes() == lp[::2].tobytes()


@pytest.mark.parametrize(
    "prompt",
    [[1, 2**31], np.array([2**32 + 5, 7]), np.array([2**63 + 5], np.uint64),
     np.arange(6, dtype=np.int32).reshape(2, 3), np.array(5, np.int32),
     np.array([1.7, 2.2]), np.array([True, False]), np.array(["1", "2"])],
)  # fmt: skip
def test_a_prompt_int32_cannot_hold_exactly_gets_the_engine_s_answer_to_it(prompt):
    """Sent as is, not cast: the engine answers it as invalid, as when it was never cast."""
    from torchtitan_rl.generation.interface import request_error

    sent = monarch_pickle(((ids_to_wire(prompt),), {})).unpickle()[0][0]
    got = request_error(ids_from_wire(sent), SamplingParams(), 64, 1000)
    assert got is not None and got == request_error(prompt, SamplingParams(), 64, 1000)


def test_a_completion_pickled_before_the_wire_format_still_loads():
    """A checkpoint's pending batches written by earlier code (a slots dataclass's state)."""
    import copyreg
    import io

    class OldPickler(pickle.Pickler):
        def reducer_override(self, obj):
            if type(obj) in (Completion, SamplingParams):
                return copyreg.__newobj__, (type(obj),), obj.__getstate__()
            return NotImplemented

    want = _completions()[0]
    buffer = io.BytesIO()
    OldPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((want, SamplingParams(seed=3)))
    assert b"_completion" not in buffer.getvalue()
    got, sampling = pickle.loads(buffer.getvalue())
    _assert_same(got, want)
    assert sampling == SamplingParams(seed=3)
