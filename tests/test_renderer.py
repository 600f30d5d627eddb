import numpy as np
import pytest

from torchtitan_rl.models.renderer import Renderer
from torchtitan_rl.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(Tokenizer.from_file())


def sampled(renderer: Renderer, text: str, stop: bool = True) -> np.ndarray:
    """What a generator would return for `text`: its tokens, then <|im_end|> if stopped."""
    ids = renderer.tokenizer.encode(text) + ([renderer.tokenizer.im_end_id] if stop else [])
    return np.asarray(ids, dtype=np.int32)


CONVERSATION = [
    {"role": "system", "content": "You sort names."},
    {"role": "user", "content": "Sort: Mary Young, Paul Adams"},
    {"role": "assistant", "content": "Paul Adams\nMary Young"},
    {"role": "user", "content": "Add Laura Hill."},
    {"role": "assistant", "content": "Paul Adams\nLaura Hill\nMary Young"},
]


def test_prompt_frames_messages_and_ends_with_assistant_header(renderer):
    prompt = renderer.render_prompt(CONVERSATION[:2])
    assert prompt.dtype == np.int32
    assert renderer.tokenizer.decode(prompt) == (
        "<|im_start|>system\nYou sort names.<|im_end|>\n"
        "<|im_start|>user\nSort: Mary Young, Paul Adams<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_stop_tokens_are_im_end_then_eos(renderer):
    tok = renderer.tokenizer
    assert renderer.stop_token_ids == (tok.im_end_id, tok.eos_id)


def test_continuation_after_stop_starts_with_newline(renderer):
    cont = renderer.render_continuation([CONVERSATION[3]], completion_ended_with_stop=True)
    assert cont.dtype == np.int32
    assert renderer.tokenizer.decode(cont) == (
        "\n<|im_start|>user\nAdd Laura Hill.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_continuation_after_truncation_closes_the_turn_first(renderer):
    cont = renderer.render_continuation([CONVERSATION[3]], completion_ended_with_stop=False)
    assert cont[0] == renderer.tokenizer.im_end_id
    assert renderer.tokenizer.decode(cont).startswith("<|im_end|>\n<|im_start|>user\n")


def test_prompt_completions_and_continuations_equal_the_demonstration(renderer):
    a0 = sampled(renderer, CONVERSATION[2]["content"])
    a1 = sampled(renderer, CONVERSATION[4]["content"])
    p0 = renderer.render_prompt(CONVERSATION[:2])
    e0 = renderer.render_continuation([CONVERSATION[3]], completion_ended_with_stop=True)
    ids, mask = renderer.render_demonstration(CONVERSATION)
    np.testing.assert_array_equal(ids, np.concatenate([p0, a0, e0, a1]))
    expected_mask = [False] * len(p0) + [True] * len(a0) + [False] * len(e0) + [True] * len(a1)
    np.testing.assert_array_equal(mask, np.asarray(expected_mask))
    assert mask.dtype == bool


def test_truncated_completion_plus_continuation_equals_closed_conversation(renderer):
    a0 = sampled(renderer, "Paul Adams\nMary", stop=False)
    p0 = renderer.render_prompt(CONVERSATION[:2])
    e0 = renderer.render_continuation([CONVERSATION[3]], completion_ended_with_stop=False)
    truncated = [*CONVERSATION[:2], {"role": "assistant", "content": "Paul Adams\nMary"}]
    ids, _ = renderer.render_demonstration(truncated + [CONVERSATION[3]])
    full = np.concatenate([p0, a0, e0])
    np.testing.assert_array_equal(ids, full[: len(ids)])
    np.testing.assert_array_equal(full[len(ids) :], renderer._header("assistant"))


def test_demonstration_mask_covers_assistant_content_and_its_im_end(renderer):
    ids, mask = renderer.render_demonstration(CONVERSATION)
    assert renderer.tokenizer.decode(ids[mask]) == (
        "Paul Adams\nMary Young<|im_end|>Paul Adams\nLaura Hill\nMary Young<|im_end|>"
    )
    assert ids[-1] == renderer.tokenizer.im_end_id


def test_parse_completion_drops_only_a_trailing_stop_token(renderer):
    tok = renderer.tokenizer
    assert renderer.parse_completion(sampled(renderer, "Mary Young")) == "Mary Young"
    assert renderer.parse_completion(tok.encode("Mary Young") + [tok.eos_id]) == "Mary Young"
    assert renderer.parse_completion(tok.encode("Mary")) == "Mary"
    inner = tok.encode("a<|im_end|>b")
    assert renderer.parse_completion(inner) == "a<|im_end|>b"
    assert renderer.parse_completion([]) == ""
