"""The generate call's message: a Completion and SamplingParams pickle as tuples with their
arrays as bytes (numpy's own reduce and a dataclass's state cost the controller's one thread
~30-45 us a turn through Monarch), and come back equal to the bit."""

import asyncio
import pickle

import numpy as np
import pytest
from fakes import MonarchLikeCall
from monarch._rust_bindings.monarch_hyperactor.pickle import pickle as monarch_pickle

from torchtitan_rl.controller.replica import ActorGenerateFn
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
