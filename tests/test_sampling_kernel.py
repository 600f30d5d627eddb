"""The fused full-vocabulary sampler (`sampling_kernel.py`) against the reference sampler
and a float64 softmax, on CPU under the Triton interpreter, with chunks small enough that
every row spans several chunks and blocks (ragged last ones).

Same draws as `sampling.sample_tokens` (one float64 uniform per row, U(seed, position) of
`keyed_random`): the same token, the log-prob within fp32 rounding of the reference's; the
edges of the draw (u = 0, u just below 1) give the first and last token with a non-zero
probability, never one at -inf."""

from __future__ import annotations

import torch
from interpreted import in_two_processes, run_interpreted


def check_interpreted() -> None:
    """Runs in a child process with TRITON_INTERPRET=1 set before triton is imported."""
    from torchtitan_rl.generation import sampling_kernel as kernel
    from torchtitan_rl.generation.keyed_random import keyed_uniform, seed_keys
    from torchtitan_rl.generation.sampling import sample_tokens

    kernel.BLOCK, kernel.CHUNK = 32, 64
    gen = torch.Generator().manual_seed(0)
    N = 24
    drawn = {V: 3 * torch.randn(N, V, generator=gen) for V in (7, 129, 300)}

    def check(V: int) -> None:
        logits_NV = drawn[V]
        logits_NV[1, : V // 2] = float("-inf")  # half the vocabulary impossible
        logits_NV[2] = 0.0  # ties everywhere
        logits_NV[3, -1] = 1e4  # one dominant id, in the last chunk
        temperature_N = torch.tensor([0.5, 1.0, 2.0, 0.7] * (N // 4))
        key_N, position_N = seed_keys(range(100 * V, 100 * V + N)), torch.arange(N) % 5
        uniform_N = keyed_uniform(key_N, position_N)
        token_N, logprob_N = kernel.sample_full_vocab(logits_NV, temperature_N, uniform_N)
        ref = sample_tokens(
            logits_NV, temperature_N=temperature_N, top_p_N=torch.ones(N),
            top_k_N=torch.zeros(N, dtype=torch.long), key_N=key_N, position_N=position_N,
        )  # fmt: skip
        assert torch.equal(token_N, ref.token_ids_N), (V, token_N, ref.token_ids_N)
        torch.testing.assert_close(logprob_N, ref.logprobs_N, atol=2e-6, rtol=0)
        exact_NV = torch.log_softmax(logits_NV.double() / temperature_N.double()[:, None], dim=-1)
        want_N = exact_NV.gather(1, token_N[:, None]).squeeze(1)
        torch.testing.assert_close(logprob_N.double(), want_N, atol=1e-5, rtol=0)
        assert bool(torch.isfinite(logprob_N).all()), logprob_N
        assert token_N[3] == V - 1 and token_N[1] >= V // 2

        # The draw's edges: the first and the last id with a non-zero probability; u = 1
        # (a draw within rounding of the end) never returns an id past them.
        tail = logits_NV[0].clone()
        tail[V // 2 :] = float("-inf")
        rows = torch.stack([logits_NV[1]] * 3 + [tail])
        edge_N = torch.tensor([0.0, 1.0 - 2.0**-53, 1.0, 1.0], dtype=torch.float64)
        token_4, logprob_4 = kernel.sample_full_vocab(rows, torch.ones(4), edge_N)
        assert token_4.tolist() == [V // 2, V - 1, V - 1, V // 2 - 1], token_4
        assert bool(torch.isfinite(logprob_4).all())

    # in two processes at once: the 300 ids take about as long as the 7 and the 129
    in_two_processes(lambda: [check(V) for V in (7, 129)], lambda: check(300))


def test_interpreted_fused_sampler_draws_the_reference_tokens():
    run_interpreted("test_sampling_kernel")
