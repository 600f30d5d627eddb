import pytest
import torch
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs

from torchtitan_rl.generation.kv_cache import SlotAllocator
from torchtitan_rl.generation.model_runner import ModelRunner

VOCAB = 97


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """Tiny-model ops are latency-bound; on a shared 2-core box, 2 OpenMP threads spin-wait
    against other processes and run ~10x slower than 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_qwen3(seed: int = 0) -> Qwen3Model:
    torch.manual_seed(seed)
    args = Qwen3ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=128,
        vocab_size=VOCAB,
        max_seq_len=64,
        enable_weight_tying=False,
    )
    model = Qwen3Model(args)
    with torch.no_grad():
        model.init_weights()
    return model


@torch.no_grad()
def full_forward_logits(model: Qwen3Model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens[None])[0].float()


def test_prefill_and_batched_decode_match_full_forward_at_every_position():
    model = tiny_qwen3()
    runner = ModelRunner(model, max_slots=4, max_seq_len=32, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompt_lens, total_len = [1, 5, 9], 20
    seqs = [torch.randint(0, VOCAB, (total_len,), generator=gen) for _ in prompt_lens]
    slots = [3, 0, 2]  # not in order, one slot unused

    logits_BV = runner.prefill(slots, [s[:n] for s, n in zip(seqs, prompt_lens)])
    steps = [logits_BV]
    # Decode each sequence from its own prompt end, all in one batch (different lengths).
    for t in range(total_len - max(prompt_lens)):
        next_B = torch.stack([s[n + t] for s, n in zip(seqs, prompt_lens)])
        steps.append(runner.decode(slots, next_B))

    for row, (seq, n) in enumerate(zip(seqs, prompt_lens)):
        ref_TV = full_forward_logits(model, seq)
        got_TV = torch.stack([step[row] for step in steps])
        positions = range(n - 1, n - 1 + len(steps))
        torch.testing.assert_close(got_TV, ref_TV[list(positions)], atol=1e-5, rtol=1e-5)


def test_prefill_in_a_reused_slot_forgets_the_old_sequence():
    model = tiny_qwen3()
    runner = ModelRunner(model, max_slots=1, max_seq_len=16, device="cpu", dtype=torch.float32)
    runner.prefill([0], [torch.arange(10)])
    runner.decode([0], torch.tensor([3]))
    prompt = torch.tensor([5, 6, 7])
    got_V = runner.prefill([0], [prompt])[0]
    torch.testing.assert_close(got_V, full_forward_logits(model, prompt)[-1], atol=1e-5, rtol=0)


def test_load_state_dict_copies_weights_in_place():
    runner = ModelRunner(
        tiny_qwen3(0), max_slots=1, max_seq_len=8, device="cpu", dtype=torch.float32
    )
    other = tiny_qwen3(1)
    prompt = torch.tensor([1, 2, 3])
    runner.load_state_dict(other.state_dict())
    torch.testing.assert_close(
        runner.prefill([0], [prompt])[0], full_forward_logits(other, prompt)[-1], atol=1e-5, rtol=0
    )


def test_load_state_dict_rejects_unknown_missing_and_misshaped_weights():
    runner = ModelRunner(
        tiny_qwen3(), max_slots=1, max_seq_len=8, device="cpu", dtype=torch.float32
    )
    state = {k: v.clone() for k, v in tiny_qwen3(1).state_dict().items()}
    with pytest.raises(ValueError, match="unknown"):
        runner.load_state_dict({**state, "layers.9.bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match="missing"):
        runner.load_state_dict({k: v for k, v in state.items() if k != "output.weight"})
    with pytest.raises(ValueError, match="shape"):
        runner.load_state_dict({**state, "norm.weight": torch.zeros(3)})


def test_decode_past_max_seq_len_is_refused():
    runner = ModelRunner(
        tiny_qwen3(), max_slots=1, max_seq_len=4, device="cpu", dtype=torch.float32
    )
    runner.prefill([0], [torch.arange(4)])
    with pytest.raises(ValueError, match="max_seq_len"):
        runner.decode([0], torch.tensor([1]))


def test_bfloat16_runner_stays_close_to_fp32_forward():
    model = tiny_qwen3()
    tokens = torch.arange(12) % VOCAB
    ref_V = full_forward_logits(model, tokens)[-1]
    runner = ModelRunner(model, max_slots=1, max_seq_len=16, device="cpu", dtype=torch.bfloat16)
    runner.prefill([0], [tokens[:6]])
    for t in range(6, 12):
        got_V = runner.decode([0], tokens[t : t + 1])[0]
    assert got_V.dtype == torch.float32
    torch.testing.assert_close(got_V, ref_V, atol=0.1, rtol=0.05)


def test_slot_allocator_hands_out_lowest_free_slot_and_refuses_double_use():
    alloc = SlotAllocator(3)
    alloc.allocate(alloc.next_free())
    alloc.allocate(alloc.next_free())
    assert alloc.num_free == 1 and alloc.next_free() == 2
    alloc.free(0)
    assert alloc.next_free() == 0
    with pytest.raises(ValueError):
        alloc.allocate(1)
    with pytest.raises(ValueError):
        alloc.free(0)
