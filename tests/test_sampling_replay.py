"""Sampling-mask replay: trainer log-probs over the generator's recorded top-p support.

A tiny random Qwen3 samples completions with the engine's `sample_tokens` (top-p 0.8,
temperature 0.7, supports recorded), then the trainer's forward scores the same tokens.
With the support replayed, trainer and generator score one distribution (softmax of
logits / temperature over the kept ids), so exp(trainer - generator) sits at 1. Without it
the trainer normalises over the whole vocabulary: each ratio is the kept mass (< 1).
Shape suffixes: B rows, S positions, V vocabulary, N loss tokens.
"""

from __future__ import annotations

import torch

from torchtitan_rl.generation.keyed_random import seed_keys
from torchtitan_rl.generation.sampling import sample_tokens
from torchtitan_rl.models.qwen3 import ModelConfig, build_model, document_attention_mask

VOCAB = 256
ROWS, PROMPT, NEW = 6, 6, 12
TOP_P, TEMPERATURE = 0.8, 0.7


def last_hidden(model, tokens_BS):
    """Final-norm hidden state at each row's last position (full recompute, no cache)."""
    B, S = tokens_BS.shape
    positions_BS = torch.arange(S).expand(B, S)
    masks = document_attention_mask(torch.zeros(B, S, dtype=torch.long))
    h = model.tok_embeddings(tokens_BS)
    for layer in model.layers.values():
        h = layer(h, model.rope_cache, masks, positions_BS)
    return model.norm(h)[:, -1]


@torch.no_grad()
def generate(model):
    """(tokens [B, PROMPT + NEW], generator log-probs [B, NEW], per-position supports)."""
    gen = torch.Generator().manual_seed(0)
    tokens_BS = torch.randint(0, VOCAB, (ROWS, PROMPT), generator=gen)
    key_N = seed_keys(range(100, 100 + ROWS))
    logprobs, supports = [], []
    for position in range(NEW):
        logits_BV = model.output(last_hidden(model, tokens_BS)).float()
        out = sample_tokens(
            logits_BV,
            temperature_N=torch.full((ROWS,), TEMPERATURE),
            top_p_N=torch.full((ROWS,), TOP_P),
            top_k_N=torch.zeros(ROWS, dtype=torch.long),
            key_N=key_N,
            position_N=torch.full((ROWS,), position),
            return_support=True,
        )
        tokens_BS = torch.cat([tokens_BS, out.token_ids_N[:, None]], dim=1)
        logprobs.append(out.logprobs_N)
        supports.append(out.support)
    return tokens_BS, torch.stack(logprobs, 1), supports


def trainer_logprobs(model, tokens_BS, supports, *, replay: bool):
    """The trainer's forward over the whole sequences, loss tokens = generated tokens."""
    inputs_BS, labels_BS = tokens_BS[:, :-1], tokens_BS[:, 1:]
    B, S = inputs_BS.shape
    is_loss_BS = torch.arange(S).expand(B, S) >= PROMPT - 1
    loss_index_N = is_loss_BS.reshape(-1).nonzero().squeeze(1)  # row-major, like the batcher
    support = None
    if replay:  # CSR in the same row-major order: row b, step i
        rows = [supports[i][b] for b in range(B) for i in range(NEW)]
        sizes = torch.tensor([0] + [len(r) for r in rows])
        support = (torch.cat(rows).long(), sizes.cumsum(0))
    logprobs_N, _ = model(
        inputs_BS, torch.arange(S).expand(B, S), torch.zeros(B, S, dtype=torch.long),
        loss_index_N, labels_BS.reshape(-1)[loss_index_N], TEMPERATURE, support,
    )  # fmt: skip
    return logprobs_N.view(B, NEW), support


def test_replayed_support_gives_ratio_one_and_full_vocab_ratio_below_one():
    torch.manual_seed(0)
    model = build_model(ModelConfig(flavor="tiny", max_seq_len=64), VOCAB, torch.device("cpu"))
    tokens_BS, generator_BN, supports = generate(model)
    kept = torch.tensor([len(s) for step in supports for s in step], dtype=torch.float)
    assert 1 < kept.mean() < VOCAB  # top-p really truncated, and kept more than one id

    with torch.no_grad():
        replayed_BN, support = trainer_logprobs(model, tokens_BS, supports, replay=True)
        full_BN, _ = trainer_logprobs(model, tokens_BS, supports, replay=False)
    ratio_replay = torch.exp(replayed_BN - generator_BN)
    ratio_full = torch.exp(full_BN - generator_BN)
    assert abs(ratio_replay.mean().item() - 1.0) < 1e-4
    assert (replayed_BN - generator_BN).abs().max() < 1e-4
    assert ratio_full.mean() < 0.95  # the kept mass: ~top_p, never above 1
    assert (ratio_full <= 1 + 1e-5).all()
    assert support[1][-1] == kept.sum()


def test_rollouter_asks_for_the_support_only_when_sampling_truncates():
    from torchtitan_rl.rollout.rollout_config import RolloutConfig

    def asks(**kw):
        params = RolloutConfig(**kw).sampling_params(seed=0, max_tokens=8, stop_token_ids=())
        return params.return_support

    assert asks(top_p=0.8) and asks(top_k=20)
    assert not asks()  # top_p = 1, top_k = 0: full vocabulary on both sides
    assert not asks(temperature=0.0, top_p=0.8)  # greedy: no truncated distribution
