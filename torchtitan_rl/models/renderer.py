"""Qwen3 chat format, token in and token out.

Every message is `<|im_start|>{role}\\n{content}<|im_end|>\\n`; a generation prompt ends
with `<|im_start|>assistant\\n`, and the model closes its turn by sampling `<|im_end|>`.
Each framing piece and each content is encoded on its own and the ids concatenated, so
token boundaries never shift, and a sampled completion is never re-tokenised. A 2-turn
rollout with user messages U0, U1 and completions A0, A1 (each ending in <|im_end|>):

    P0 = render_prompt([U0])          = <|im_start|>user\\n U0 <|im_end|>\\n <|im_start|>assistant\\n
    E0 = render_continuation([U1], True) = \\n <|im_start|>user\\n U1 <|im_end|>\\n <|im_start|>assistant\\n
    P0 + A0 + E0 + A1 == render_demonstration([U0, A0, U1, A1])[0]
    mask                = [0]*len(P0) + [1]*len(A0) + [0]*len(E0) + [1]*len(A1)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from torchtitan_rl.models.tokenizer import Tokenizer
from torchtitan_rl.types import Message

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""The same format as a Hugging Face chat template (Jinja), written into exported folders:
`apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` gives exactly
`render_prompt(messages)` (tests/test_hf_export.py)."""


class Renderer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._newline = tokenizer.encode("\n")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.im_end_id, self.tokenizer.eos_id)

    def closed_by_stop_token(self, completion) -> bool:
        """Whether `completion` sampled its own closing token. A turn cut off by max_tokens,
        or ended by a `rollout.stop` text, gets it from `render_continuation` instead."""
        ids = completion.token_ids_N
        return len(ids) > 0 and int(ids[-1]) in self.stop_token_ids

    def stop_sequence(self, text: str) -> tuple[int, ...]:
        """The token ids that end a turn at `text` (see `rollout.stop`)."""
        return tuple(self.tokenizer.encode(text))

    def _header(self, role: str) -> list[int]:
        """`<|im_start|>{role}\\n`."""
        return [self.tokenizer.im_start_id, *self.tokenizer.encode(f"{role}\n")]

    def _message(self, message: Message) -> tuple[list[int], list[int], list[int]]:
        """(header, content + <|im_end|>, trailing newline) of one message."""
        body = [*self.tokenizer.encode(message["content"]), self.tokenizer.im_end_id]
        return self._header(message["role"]), body, self._newline

    def _messages(self, messages: Sequence[Message]) -> list[int]:
        ids: list[int] = []
        for message in messages:
            for part in self._message(message):
                ids.extend(part)
        return ids

    def render_prompt(self, messages: Sequence[Message]) -> np.ndarray:
        """All messages, then `<|im_start|>assistant\\n`; int32 [L]."""
        ids = self._messages(messages) + self._header("assistant")
        return np.asarray(ids, dtype=np.int32)

    def render_continuation(
        self, messages: Sequence[Message], completion_ended_with_stop: bool
    ) -> np.ndarray:
        """Tokens to append after a completion: its closing (`<|im_end|>` only if the
        completion was cut off before sampling it) and newline, the env's reply messages,
        then `<|im_start|>assistant\\n`; int32 [L]."""
        closing = [] if completion_ended_with_stop else [self.tokenizer.im_end_id]
        ids = closing + self._newline + self._messages(messages) + self._header("assistant")
        return np.asarray(ids, dtype=np.int32)

    def parse_completion(self, token_ids: Sequence[int] | np.ndarray) -> str:
        """The completion's text, without its trailing stop token."""
        ids = [int(i) for i in token_ids]
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    def render_demonstration(self, messages: Sequence[Message]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int32 [L], loss mask bool [L]) of a whole conversation.

        The mask is True on each assistant content and its closing `<|im_end|>`: exactly the
        tokens a rollout samples. Nothing follows the last assistant `<|im_end|>`, as in a
        rollout, so the ids equal prompt + completion + continuation + ... rendering.
        """
        ids: list[int] = []
        mask: list[bool] = []
        for i, message in enumerate(messages):
            header, body, newline = self._message(message)
            is_assistant = message["role"] == "assistant"
            ids += header + body
            mask += [False] * len(header) + [is_assistant] * len(body)
            if not (is_assistant and i == len(messages) - 1):
                ids += newline
                mask += [False] * len(newline)
        return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)
