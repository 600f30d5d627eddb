"""The batch-invariant kernels (`generation/invariant_kernels.py`) and the runner's CUDA
batch-invariant mode built on them, on CPU under the Triton interpreter: each against a
float64 reference, and each row's result the same bits whatever rows share the call
(subsets, other orders, other counts across tile edges).

The interpreter multiplies bfloat16 tiles as raw 16-bit integers and rounds float32 to
bfloat16 by truncation; `_emulate_gpu_bf16` makes it compute what the GPU does (products of
bfloat16 values exact in fp32, round to nearest even) so bf16 results can be checked.
The same checks on a GPU: tests/test_batch_invariance_gpu.py."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from interpreted import in_two_processes, run_interpreted


def _emulate_gpu_bf16() -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def to_f32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = torch.from_numpy(h.data.astype(np.uint16).view(np.int16).copy())
        return TensorHandle(bits.view(torch.bfloat16).float().numpy(), tl.float32)

    dot, cast = InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, to_f32(a), to_f32(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bf16 = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return TensorHandle(bf16.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return (
            cast(self, to_f32(src), dst_type)
            if src.dtype.scalar == tl.bfloat16
            else cast(self, src, dst_type)
        )

    InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl = create_dot, cast_impl


def _rows_alone_match(fn, x: torch.Tensor, full: torch.Tensor, cuts) -> None:
    """`fn` over slices and a shuffle of `x`'s rows gives `full`'s rows, bit for bit."""
    for lo, hi in cuts:
        assert torch.equal(fn(x[lo:hi]), full[lo:hi]), (lo, hi)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.equal(fn(x[perm]), full[perm])


def _linear_rows(x_MK: torch.Tensor, *, w_NK: torch.Tensor) -> torch.Tensor:
    from torchtitan_rl.generation.invariant_kernels import linear

    return linear(x_MK, w_NK)


def check_kernels() -> None:
    from torchtitan_rl.generation import invariant_kernels as ik

    _emulate_gpu_bf16()
    gen = torch.Generator().manual_seed(0)
    cuts = [(0, 1), (5, 6), (63, 64), (64, 65), (3, 70), (0, 150), (100, 150)]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2.0**-7)):
        # K not a multiple of BLOCK_K, N not a multiple of BLOCK_N, M over three row tiles
        x_MK = torch.randn(150, 200, generator=gen).to(dtype)
        w_NK = torch.randn(70, 200, generator=gen).to(dtype)
        full = ik.linear(x_MK, w_NK)
        assert full.dtype == dtype and full.shape == (150, 70)
        want = x_MK.double() @ w_NK.double().T
        torch.testing.assert_close(full.double(), want, rtol=tol, atol=tol * 15)
        _rows_alone_match(functools.partial(_linear_rows, w_NK=w_NK), x_MK, full, cuts)
        # a strided input (every other row) is read as such
        assert torch.equal(ik.linear(x_MK[::2], w_NK), full[::2])

        norm = torch.nn.RMSNorm(48, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(48, generator=gen))
        x_MHD = torch.randn(40, 5, 48, generator=gen).to(dtype)
        y = ik.rms_norm(norm, x_MHD)
        x64 = x_MHD.double()
        want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
        torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(y, norm(x_MHD), rtol=tol, atol=tol)
        _rows_alone_match(functools.partial(ik.rms_norm, norm), x_MHD, y, [(0, 1), (7, 30)])
        assert torch.equal(ik.rms_norm(norm, x_MHD[:, 1:3]), y[:, 1:3])  # strided heads
        assert torch.equal(ik.rms_norm(norm, x_MHD[:, 2]), y[:, 2])  # 2-D, strided rows

    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-13)):
        x_RV = torch.rand(6, 2500, generator=gen, dtype=torch.float64).to(dtype)
        c = ik.row_cumsum(x_RV)
        torch.testing.assert_close(c.double(), x_RV.double().cumsum(-1), rtol=tol, atol=tol)
        assert bool((c[:, 1:] >= c[:, :-1]).all())
        _rows_alone_match(ik.row_cumsum, x_RV, c, [(0, 1), (2, 5)])


def test_interpreted_invariant_kernels_match_float64_and_each_rows_bits():
    run_interpreted("test_invariant_kernels", "check_kernels")


def interpreted_invariant_runner(model, **kwargs):
    """A CPU runner switched to the CUDA batch-invariant mode (the Triton paged attention
    and invariant kernels, run by the interpreter)."""
    from test_model_runner import make_runner

    runner = make_runner(model, **kwargs)
    runner.decode_attention, runner.invariant_kernels = "triton", True
    runner._use_invariant_kernels()
    return runner


def check_runner() -> None:
    """The mode's packed step: a row's logits are the same bits beside any rows, a prompt
    prefilled in one step gives the bits of feeding it token by token, and the logits are
    those of a float64 runner up to fp32 rounding. The two checks after the shared prefill
    run in two processes at once."""
    from fakes import tiny_qwen3
    from test_model_runner import VOCAB, make_runner

    from torchtitan_rl.generation.model_runner import SeqInput

    state = tiny_qwen3().state_dict()
    runner = interpreted_invariant_runner(tiny_qwen3(), num_blocks=96, max_seq_len=64)
    exact = make_runner(tiny_qwen3(), num_blocks=96, max_seq_len=64, dtype=torch.float64)
    for r in (runner, exact):
        r.load_state_dict(state)
    tokens = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    table = list(range(8))
    n = 21  # the row's position: past a block edge and past one 16-position attention tile
    for r in (runner, exact):
        r.forward([SeqInput(token_ids=tokens[:n], start=0, block_table=table)])
    row = SeqInput(token_ids=[tokens[n]], start=n, block_table=table)
    alone = runner.forward([row]).clone()
    torch.testing.assert_close(alone, exact.forward([row]), atol=1e-4, rtol=1e-4)

    def beside_others():
        for others in (1, 16, 40):
            beside = [
                SeqInput(
                    token_ids=[tokens[i % 64]], start=40 + i % 20, block_table=list(range(16, 32))
                )
                for i in range(others - 1)
            ]
            beside.append(SeqInput(token_ids=tokens[:9], start=0, block_table=list(range(40, 48))))
            mixed = runner.forward([*beside[: others // 2], row, *beside[others // 2 :]])
            assert torch.equal(mixed[others // 2], alone[0]), others

    def prefill_and_token_by_token():
        # the same n + 1 tokens in fresh blocks: one prefill step, then token by token
        at_once = runner.forward(
            [SeqInput(token_ids=tokens[: n + 1], start=0, block_table=list(range(50, 58)))]
        )
        for t in range(n + 1):
            one = runner.forward(
                [SeqInput(token_ids=[tokens[t]], start=t, block_table=list(range(60, 68)))]
            )
        assert torch.equal(at_once, alone) and torch.equal(one, alone)

    in_two_processes(beside_others, prefill_and_token_by_token)


def test_interpreted_invariant_runner_gives_each_row_its_own_bits():
    run_interpreted("test_invariant_kernels", "check_runner")


def check_engine() -> None:
    """The engine on the mode's packed step (eager, look-ahead on): every request gets the
    same bits alone and beside others in another order. The two engines run in two
    processes at once."""
    import asyncio
    import pickle
    import tempfile
    from dataclasses import replace

    from fakes import tiny_qwen3
    from test_batch_invariance import PROMPTS, SAMPLINGS

    from torchtitan_rl.generation.engine import Engine
    from torchtitan_rl.generation.interface import EngineConfig

    def engine(max_num_seqs: int) -> Engine:
        config = EngineConfig(max_num_seqs=max_num_seqs, max_seq_len=96, block_size=4)
        # one layer: the engine's part (scheduling, look-ahead, keyed draws) needs no more,
        # and each step is half the interpreted kernels (check_runner keeps two layers)
        model = tiny_qwen3(n_layers=1)
        e = Engine(model, config, threaded=False, look_ahead=True, steps_per_yield=1)
        e.runner.decode_attention, e.runner.invariant_kernels = "triton", True
        e.runner._use_invariant_kernels()
        return e

    # fewer tokens than test_batch_invariance's (each step is slow under the interpreter),
    # still ending at different steps: in three slots, prefills join other rows' decodes
    samplings = [replace(s, max_tokens=5 + 3 * (i % 3)) for i, s in enumerate(SAMPLINGS)]

    async def together(e, order):
        outs = await asyncio.gather(
            *(e.generate(PROMPTS[i], request_id=str(i), sampling=samplings[i]) for i in order)
        )
        await e.close()
        return {i: (out.token_ids_N, out.logprobs_N) for i, out in zip(order, outs)}

    order = list(range(len(PROMPTS)))
    with tempfile.TemporaryDirectory() as tmp:
        ref_path, got_path = Path(tmp) / "ref.pkl", Path(tmp) / "got.pkl"

        def run(path: Path, max_num_seqs: int, order: list[int]):
            return lambda: path.write_bytes(
                pickle.dumps(asyncio.run(together(engine(max_num_seqs), order)))
            )

        in_two_processes(
            run(ref_path, 1, order),  # one at a time
            run(got_path, 3, [5, 0, 7, 2, 6, 1, 4, 3]),  # three slots, shuffled
        )
        ref, got = (pickle.loads(p.read_bytes()) for p in (ref_path, got_path))
    for i in order:
        assert np.array_equal(got[i][0], ref[i][0]), i
        assert np.array_equal(got[i][1], ref[i][1]), i


def test_interpreted_invariant_engine_gives_each_request_its_bits():
    run_interpreted("test_invariant_kernels", "check_engine")
