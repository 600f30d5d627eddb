"""Train the shipped byte-level BPE tokenizer (torchtitan_rl/models/assets/tokenizer.json).

    python -m scripts.build_tokenizer [--vocab-size 1024] [--out PATH]

The corpus is AlphabetSort conversations (prompts, gold answers, imperfect replies, chat
role lines) plus a little general ASCII text. Bytes are the base alphabet, so any text
encodes; merges make names and answer tags a few tokens each. Deterministic: the same
arguments give the same file.
"""

from __future__ import annotations

import argparse
import random
import string
from collections.abc import Iterator
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from torchtitan_rl.envs.alphabet_sort import AlphabetSort, AlphabetSortConfig
from torchtitan_rl.envs.base import EnvConfig
from torchtitan_rl.models.tokenizer import SHIPPED_TOKENIZER_PATH, SPECIAL_TOKENS

VOCAB_MULTIPLE = 64
"""Final vocab size is padded up to this (embedding tables like aligned sizes)."""

# Pre-token pieces: whole <tags> and "// comments" (answers mark names with " // new
# name!"), optionally space-led words, numbers up to 3 digits, punctuation runs,
# whitespace. BPE never merges across them.
SPLIT_PATTERN = (
    r" ?</?[A-Za-z_]+>| ?//[^\n]*|'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]{1,3}"
    r"| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"
)

GENERAL_TEXT = """\
The quick brown fox jumps over the lazy dog. Sorting is putting things in order:
alphabetical order compares letters from left to right, and a tie on one key is broken
by the next. Answer the question, then stop. Here is a list, one item per line.
I think the answer is correct, but let me check it again before I reply.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Symbols: (a, b) [c] {d} "e" 'f' x = y + z;
"""


def empty_tokenizer() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def imperfect_reply(gold: str, rng: random.Random) -> str:
    """A plausible wrong answer: shuffled, dropped or lower-cased lines, or no tags."""
    lines = gold.splitlines()
    body = lines[1:-1]
    kind = rng.randrange(4)
    if kind == 0:
        rng.shuffle(body)
    elif kind == 1 and len(body) > 1:
        body.pop(rng.randrange(len(body)))
    elif kind == 2:
        body = [line.lower() for line in body]
    else:
        return "\n".join(body)
    return "\n".join([lines[0], *body, lines[-1]])


def corpus(num_samples: int, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    for max_turns in (1, 2, 3, 4):
        env = AlphabetSort(EnvConfig(max_turns=max_turns), seed, AlphabetSortConfig())
        for index in range(num_samples // 4):
            for message in env.demonstration(env.train_sample(index)):
                yield f"{message['role']}\n"
                yield message["content"]
                if message["role"] == "assistant" and rng.random() < 0.3:
                    yield imperfect_reply(message["content"], rng)
                yield "\n"
    for role in ("system", "user", "assistant"):
        yield f"{role}\n"
    yield GENERAL_TEXT
    yield string.printable


def build(vocab_size: int, num_samples: int, seed: int) -> tokenizers.Tokenizer:
    tok = empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(num_samples, seed), trainer=trainer)
    size = tok.get_vocab_size(with_added_tokens=True)
    padding = -size % VOCAB_MULTIPLE
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(padding)])
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--num-samples", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=SHIPPED_TOKENIZER_PATH)
    args = parser.parse_args()
    tok = build(args.vocab_size, args.num_samples, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out), pretty=True)
    print(f"wrote {args.out}: vocab size {tok.get_vocab_size(with_added_tokens=True)}")


if __name__ == "__main__":
    main()
