import pytest
import torch
from fakes import tiny_qwen3
from torchtitan.models.qwen3 import Qwen3Model

from torchtitan_rl.generation.model_runner import ModelRunner, SeqInput

VOCAB = 97


@torch.no_grad()
def full_forward_logits(model: Qwen3Model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens[None])[0].float()


def make_runner(model, *, num_blocks=16, block_size=4, max_seq_len=32, dtype=torch.float32):
    return ModelRunner(
        model,
        num_blocks=num_blocks,
        block_size=block_size,
        max_seq_len=max_seq_len,
        device="cpu",
        dtype=dtype,
    )


def test_prefill_and_batched_decode_match_full_forward_at_every_position():
    model = tiny_qwen3()
    runner = make_runner(model, num_blocks=24)
    gen = torch.Generator().manual_seed(1)
    prompt_lens, total_len = [1, 5, 9], 20
    seqs = [torch.randint(0, VOCAB, (total_len,), generator=gen).tolist() for _ in prompt_lens]
    # Scattered, interleaved blocks: the block table, not contiguity, places each token.
    tables = [[3, 10, 0, 17, 6], [12, 1, 8, 20, 5], [4, 19, 2, 15, 9]]

    batch = [
        SeqInput(token_ids=s[:n], start=0, block_table=t)
        for s, n, t in zip(seqs, prompt_lens, tables)
    ]
    steps = [runner.forward(batch)]
    # Decode each sequence from its own prompt end, all in one batch (different lengths).
    for t in range(total_len - max(prompt_lens)):
        batch = [
            SeqInput(token_ids=[s[n + t]], start=n + t, block_table=tb)
            for s, n, tb in zip(seqs, prompt_lens, tables)
        ]
        steps.append(runner.forward(batch))

    for row, (seq, n) in enumerate(zip(seqs, prompt_lens)):
        ref_TV = full_forward_logits(model, torch.tensor(seq))
        got_TV = torch.stack([step[row] for step in steps])
        positions = range(n - 1, n - 1 + len(steps))
        torch.testing.assert_close(got_TV, ref_TV[list(positions)], atol=1e-5, rtol=1e-5)


def test_mixed_batch_prefill_runs_before_decode_reading_shared_blocks():
    model = tiny_qwen3()
    runner = make_runner(model)
    tokens = list(range(10, 19))  # 9 tokens: blocks [5, 6] full, block 7 partial
    # Sequence b shares a's first two blocks, which a writes in this same forward.
    a = SeqInput(token_ids=tokens, start=0, block_table=[5, 6, 7])
    b = SeqInput(token_ids=[tokens[8]], start=8, block_table=[5, 6, 2])
    logits_BV = runner.forward([b, a])
    ref_V = full_forward_logits(model, torch.tensor(tokens))[-1]
    torch.testing.assert_close(logits_BV[0], ref_V, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_BV[1], ref_V, atol=1e-5, rtol=1e-5)


def test_decode_path_matches_padded_path():
    model = tiny_qwen3()
    runner = make_runner(model)
    runner.forward([SeqInput(token_ids=list(range(7)), start=0, block_table=[1, 2])])
    decode_V = runner.forward([SeqInput(token_ids=[7], start=7, block_table=[1, 2])])[0]
    padded_V = runner._forward_padded([SeqInput(token_ids=[7], start=7, block_table=[1, 2])])[0]
    torch.testing.assert_close(decode_V, padded_V, atol=1e-5, rtol=1e-5)


def test_load_state_dict_copies_weights_in_place():
    runner = make_runner(tiny_qwen3(0))
    other = tiny_qwen3(1)
    prompt = torch.tensor([1, 2, 3])
    runner.load_state_dict(other.state_dict())
    torch.testing.assert_close(
        runner.forward([SeqInput(token_ids=prompt.tolist(), start=0, block_table=[0])])[0],
        full_forward_logits(other, prompt)[-1],
        atol=1e-5,
        rtol=0,
    )


def test_load_state_dict_rejects_unknown_missing_and_misshaped_weights():
    runner = make_runner(tiny_qwen3())
    state = {k: v.clone() for k, v in tiny_qwen3(1).state_dict().items()}
    with pytest.raises(ValueError, match="unknown"):
        runner.load_state_dict({**state, "layers.9.bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match="missing"):
        runner.load_state_dict({k: v for k, v in state.items() if k != "output.weight"})
    with pytest.raises(ValueError, match="shape"):
        runner.load_state_dict({**state, "norm.weight": torch.zeros(3)})


def test_decode_past_max_seq_len_is_refused():
    runner = make_runner(tiny_qwen3(), max_seq_len=4)
    runner.forward([SeqInput(token_ids=[0, 1, 2, 3], start=0, block_table=[0])])
    with pytest.raises(ValueError, match="max_seq_len"):
        runner.forward([SeqInput(token_ids=[1], start=4, block_table=[0, 1])])


def test_bfloat16_runner_stays_close_to_fp32_forward():
    model = tiny_qwen3()
    tokens = torch.arange(12) % VOCAB
    ref_V = full_forward_logits(model, tokens)[-1]
    runner = make_runner(model, dtype=torch.bfloat16)
    table = [3, 0, 1]
    runner.forward([SeqInput(token_ids=tokens[:6].tolist(), start=0, block_table=table)])
    for t in range(6, 12):
        got_V = runner.forward([SeqInput(token_ids=[int(tokens[t])], start=t, block_table=table)])[
            0
        ]
    assert got_V.dtype == torch.float32
    torch.testing.assert_close(got_V, ref_V, atol=0.1, rtol=0.05)


def test_packed_projections_give_the_same_logits_and_take_weight_pulls():
    """`pack_projections` (used on CUDA with compiled decode) runs q/k/v and w1/w3 as one
    matmul each over views of one matrix: same logits, no copy of the weights, and a
    weight pull afterwards reaches the packed matrices."""
    torch.manual_seed(0)
    model = tiny_qwen3()
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    plain, packed = make_runner(model), make_runner(tiny_qwen3())
    packed.load_state_dict(plain.model.state_dict())
    packed.pack_projections()
    attn = next(iter(packed.model.layers.values())).attention
    assert attn.wk.weight.untyped_storage().data_ptr() == attn.packed_qkv_weight.data_ptr()
    batch = [SeqInput(token_ids=[3, 1, 4, 1, 5], start=0, block_table=[0, 1])]
    decode = [SeqInput(token_ids=[9], start=5, block_table=[0, 1])]
    first = packed.forward(batch).clone()
    torch.testing.assert_close(first, plain.forward(batch), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.forward(decode), plain.forward(decode), atol=1e-5, rtol=1e-5)
    plain.load_state_dict(new_state)
    packed.load_state_dict(new_state)
    pulled = packed.forward(batch)
    torch.testing.assert_close(pulled, plain.forward(batch), atol=1e-5, rtol=1e-5)
    assert (pulled - first).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefill_and_mixed_batch_never_wait_for_the_device():
    """A forward that prefills (rows of different lengths, next to a decode row) queues all
    its work without a host-device sync: the engine's look-ahead keeps the next decode step
    queued meanwhile. A boolean-mask index or a plain host-to-device copy would sync, and
    `set_sync_debug_mode("error")` raises on any. Logits match the CPU runner's."""
    torch.manual_seed(0)
    state = tiny_qwen3().state_dict()
    cpu, gpu = (
        make_runner(tiny_qwen3()),
        ModelRunner(
            tiny_qwen3(),
            num_blocks=16,
            block_size=4,
            max_seq_len=32,
            device="cuda",
            dtype=torch.float32,
        ),
    )
    cpu.load_state_dict(state)
    gpu.load_state_dict(state)
    first = [
        SeqInput(token_ids=[3, 1, 4, 1, 5, 9, 2], start=0, block_table=[0, 1]),
        SeqInput(token_ids=[2, 7], start=0, block_table=[2]),
    ]
    mixed = [
        SeqInput(token_ids=[6], start=7, block_table=[0, 1]),
        SeqInput(token_ids=[1, 8, 2, 8, 1], start=2, block_table=[2, 3]),
        SeqInput(token_ids=[5, 3, 5], start=0, block_table=[4]),
    ]
    for batch in (first, mixed):
        ref = cpu.forward(batch)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = gpu.forward(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)
