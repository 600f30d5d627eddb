import string

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_rl.envs.alphabet_sort import COMBINED_TAG, NEW_MARK, SORTED_TAG, load_names
from torchtitan_rl.models.tokenizer import SHIPPED_TOKENIZER_PATH, SPECIAL_TOKENS, Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file()


def test_shipped_vocab_is_small_and_padded_to_64(tok):
    assert tok.vocab_size % 64 == 0
    assert 256 < tok.vocab_size <= 1088


def test_chat_special_tokens_have_distinct_ids_and_eos_pads(tok):
    ids = [tok.token_id(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert tok.eos_id == tok.pad_id == tok.token_id("<|endoftext|>")
    assert tok.im_start_id == tok.token_id("<|im_start|>")
    assert tok.im_end_id == tok.token_id("<|im_end|>")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=string.printable, max_size=200))
def test_decode_encode_round_trips_printable_ascii(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_token_strings_in_text_map_to_their_ids(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><think>x</think><|endoftext|>")
    assert ids[0] == tok.im_start_id
    for token in SPECIAL_TOKENS:
        assert tok.token_id(token) in ids
    assert tok.encode("hi") == tok.encode("hi")  # no BOS/EOS injected
    assert tok.im_start_id not in tok.encode("user\nhi")


def test_decode_can_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>hello world<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    assert tok.decode(ids) == "<|im_start|>hello world<|im_end|>"


def test_answer_tags_and_new_name_mark_are_single_tokens(tok):
    for text in (f"<{SORTED_TAG}>", f"</{SORTED_TAG}>", f"<{COMBINED_TAG}>", NEW_MARK):
        assert len(tok.encode(text)) == 1, text


def test_every_pool_name_encodes_in_at_most_three_tokens(tok):
    assert max(len(tok.encode(name)) for name in load_names()) <= 3


def test_from_file_accepts_a_folder_holding_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text(SHIPPED_TOKENIZER_PATH.read_text())
    folder_tok = Tokenizer.from_file(str(tmp_path))
    assert folder_tok.encode("Mary Young") == Tokenizer.from_file().encode("Mary Young")


def test_from_file_rejects_a_missing_path(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_file(str(tmp_path / "nowhere"))


def test_tokenizer_without_chat_tokens_is_rejected(tmp_path):
    bare = tokenizers.Tokenizer(tokenizers.models.BPE())
    bare.add_special_tokens(["<|endoftext|>"])
    bare.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="<\\|im_start\\|>"):
        Tokenizer.from_file(str(tmp_path))


def test_build_tokenizer_is_deterministic():
    from scripts.build_tokenizer import build

    first = build(vocab_size=512, num_samples=200, seed=0).to_str()
    second = build(vocab_size=512, num_samples=200, seed=0).to_str()
    assert first == second
    assert tokenizers.Tokenizer.from_str(first).get_vocab_size() % 64 == 0
