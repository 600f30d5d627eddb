"""FakeRenderer, the byte-level chat renderer of the tests, in a module of its own: env
worker processes unpickle it (env.workers > 0), and this module imports neither torch nor the
model, so a worker loads it in a moment.

Tokens: bytes 0..255 are themselves, IM_START = 256, IM_END = 257 (the stop token). A
rendered message is IM_START + "role\\ncontent" + IM_END + "\\n", like ChatML.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from torchtitan_rl.types import Message

IM_START = 256
IM_END = 257
NEWLINE = ord("\n")


def encode(text: str) -> list[int]:
    return list(text.encode())


class FakeRenderer:
    """ChatML-shaped byte renderer with the Renderer interface."""

    stop_token_ids: tuple[int, ...] = (IM_END,)

    def _message(self, message: Message) -> list[int]:
        return [IM_START, *encode(f"{message['role']}\n{message['content']}"), IM_END, NEWLINE]

    def _header(self) -> list[int]:
        return [IM_START, *encode("assistant\n")]

    def render_prompt(self, messages: Sequence[Message]) -> np.ndarray:
        ids = [t for m in messages for t in self._message(m)] + self._header()
        return np.array(ids, dtype=np.int32)

    def render_continuation(
        self, messages: Sequence[Message], completion_ended_with_stop: bool
    ) -> np.ndarray:
        ids = [NEWLINE] if completion_ended_with_stop else [IM_END, NEWLINE]
        ids += [t for m in messages for t in self._message(m)] + self._header()
        return np.array(ids, dtype=np.int32)

    def stop_sequence(self, text: str) -> tuple[int, ...]:
        return tuple(encode(text))

    def closed_by_stop_token(self, completion) -> bool:
        ids = completion.token_ids_N
        return len(ids) > 0 and int(ids[-1]) in self.stop_token_ids

    def parse_completion(self, token_ids: np.ndarray) -> str:
        ids = [int(t) for t in token_ids if int(t) < 256]
        return bytes(ids).decode(errors="replace")


class PickyRenderer(FakeRenderer):
    """A FakeRenderer that cannot parse a completion holding a token over IM_END."""

    def parse_completion(self, token_ids: np.ndarray) -> str:
        if any(int(t) > IM_END for t in token_ids):
            raise ValueError(f"token {max(int(t) for t in token_ids)} is not in the vocabulary")
        return super().parse_completion(token_ids)


class WhereRenderer(FakeRenderer):
    """A FakeRenderer that says in which process it tokenized: each call of a method touches
    the file `{folder}/{method}-{pid}`."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def _mark(self, method: str) -> None:
        (self.folder / f"{method}-{os.getpid()}").touch()

    def render_prompt(self, messages: Sequence[Message]) -> np.ndarray:
        self._mark("render_prompt")
        return super().render_prompt(messages)

    def render_continuation(
        self, messages: Sequence[Message], completion_ended_with_stop: bool
    ) -> np.ndarray:
        self._mark("render_continuation")
        return super().render_continuation(messages, completion_ended_with_stop)

    def parse_completion(self, token_ids: np.ndarray) -> str:
        self._mark("parse_completion")
        return super().parse_completion(token_ids)

    def pids(self) -> dict[str, set[int]]:
        """{method: the pids of the processes it ran in}."""
        found: dict[str, set[int]] = {}
        for path in self.folder.iterdir():
            method, pid = path.name.rsplit("-", 1)
            found.setdefault(method, set()).add(int(pid))
        return found


class DiesParsingRenderer(PickyRenderer):
    """A PickyRenderer whose process dies, in an env worker, parsing what it cannot parse
    (as a native tokenizer crashing, or a worker killed mid-parse); in the process that made
    it (the controller) it raises RuntimeError on it: that parse must never run there."""

    def __init__(self):
        self.home_pid = os.getpid()

    def parse_completion(self, token_ids: np.ndarray) -> str:
        if any(int(t) > IM_END for t in token_ids):
            if os.getpid() != self.home_pid:
                os._exit(3)
            raise RuntimeError("parsed again on the controller's event loop")
        return super().parse_completion(token_ids)


UNDECODABLE = 301
"""A token FussyRenderer's decoding raises KeyError on."""


class FussyRenderer(FakeRenderer):
    """A FakeRenderer whose decoding raises KeyError on UNDECODABLE (as a tokenizer's id
    lookup) and whose encoding raises RuntimeError on a message holding pool_envs.UNENCODABLE
    (as a tokenizer refusing a special token's text)."""

    def _message(self, message: Message) -> list[int]:
        if "<unencodable>" in message["content"]:
            raise RuntimeError(f"cannot encode {message['content']!r}")
        return super()._message(message)

    def parse_completion(self, token_ids: np.ndarray) -> str:
        if any(int(t) == UNDECODABLE for t in token_ids):
            raise KeyError(UNDECODABLE)
        return super().parse_completion(token_ids)


STUCK = 300
"""A token HangsParsingRenderer never finishes parsing."""


class HangsParsingRenderer(FakeRenderer):
    """A FakeRenderer whose parse never ends on a completion holding STUCK (as a regex that
    blows up on one long completion), in whichever process parses it."""

    def parse_completion(self, token_ids: np.ndarray) -> str:
        if any(int(t) == STUCK for t in token_ids):
            threading.Event().wait()
        return super().parse_completion(token_ids)


class BreaksLaterRenderer(FakeRenderer):
    """A FakeRenderer that a worker process cannot load once the file `{folder}/broken`
    exists: the workers started before load it, their replacements after cannot."""

    def __init__(self, folder: str):
        self.folder = folder

    def __setstate__(self, state: dict) -> None:
        if (Path(state["folder"]) / "broken").exists():
            raise RuntimeError("its files are gone")
        self.__dict__.update(state)


UNCLOSABLE = 302
"""A token StopCheckRaisesRenderer's stop-token check raises on."""


class StopCheckRaisesRenderer(FakeRenderer):
    """A FakeRenderer whose `closed_by_stop_token` raises IndexError on a completion holding
    UNCLOSABLE (as a stop-token lookup past the vocabulary's end)."""

    def closed_by_stop_token(self, completion) -> bool:
        if any(int(t) == UNCLOSABLE for t in completion.token_ids_N):
            raise IndexError(f"token {UNCLOSABLE} is past the vocabulary")
        return super().closed_by_stop_token(completion)
