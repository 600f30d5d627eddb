"""Token ids <-> text, over a HF `tokenizers` file.

The shipped tokenizer (`assets/tokenizer.json`, built by `scripts/build_tokenizer.py`) is a
byte-level BPE of about 1k tokens trained on AlphabetSort conversations, so any text
encodes and short sequences keep the CPU model fast. A real Qwen3 checkpoint folder works
too: the chat special tokens are looked up by name in its tokenizer.json.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import tokenizers

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, THINK_START_TOKEN, THINK_END_TOKEN)
"""Qwen3 chat tokens, in the id order the shipped tokenizer gives them (0..4)."""

SHIPPED_TOKENIZER_PATH = Path(__file__).parent / "assets" / "tokenizer.json"


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer`; `encode` never injects special tokens."""

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, *, source: str = "<memory>"):
        self._tok = hf_tokenizer
        self._special_ids: dict[str, int] = {}
        for token in SPECIAL_TOKENS:
            token_id = hf_tokenizer.token_to_id(token)
            if token_id is None:
                raise ValueError(
                    f"tokenizer {source} lacks the special token {token!r}; "
                    f"needed: {', '.join(SPECIAL_TOKENS)}"
                )
            self._special_ids[token] = token_id

    @classmethod
    def from_file(cls, path: str | None = None) -> Tokenizer:
        """Load a tokenizer.json, or a folder holding one; None loads the shipped tokenizer."""
        resolved = SHIPPED_TOKENIZER_PATH if path is None else Path(path)
        if resolved.is_dir():
            resolved = resolved / "tokenizer.json"
        if not resolved.is_file():
            raise ValueError(
                f"tokenizer path {path!r}: no tokenizer.json found at {str(resolved)!r}; "
                "give a tokenizer.json file, a folder holding one, or None for the shipped one"
            )
        return cls(tokenizers.Tokenizer.from_file(str(resolved)), source=str(resolved))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings inside it map to their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        """Id of one whole token string, e.g. "<think>"."""
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Ids in use, added tokens included (the model's embedding may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def im_start_id(self) -> int:
        return self._special_ids[IM_START_TOKEN]

    @property
    def im_end_id(self) -> int:
        return self._special_ids[IM_END_TOKEN]

    @property
    def eos_id(self) -> int:
        return self._special_ids[EOS_TOKEN]

    @property
    def pad_id(self) -> int:
        return self._special_ids[EOS_TOKEN]
