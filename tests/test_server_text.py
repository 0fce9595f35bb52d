"""A streamed choice's text (server/choice.Text): decoding only the ids after the settled prefix gives
`tokenizer.decode` of all of them, token by token or several at a time, through special tokens and
characters split over tokens; tokenizers it cannot cut (not byte-level, a clean-up pass) decode whole."""

import random

import pytest

from clover.api import DEFAULT_MODEL
from clover.server.choice import Choice, Text, byte_level


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def pieces(tokenizer, rng: random.Random) -> list[int]:
    """Ids that split characters over tokens (emoji, CJK bytes), special and added tokens, plain ids."""
    ids = tokenizer("héllo 世界 🙂🙂 naïve <think> x</think>", add_special_tokens=False).input_ids
    bytes_ids = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    special = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<think>")]
    pool = ids + bytes_ids[:64] + special + [rng.randrange(len(tokenizer)) for _ in range(32)]
    return [rng.choice(pool) for _ in range(rng.randrange(1, 120))]


def test_default_tokenizer_is_cut(tokenizer):
    assert byte_level(tokenizer)
    assert Text(tokenizer).backend is not None


@pytest.mark.parametrize("seed", range(8))
def test_growing_ids_decode_as_the_whole(tokenizer, seed):
    rng = random.Random(seed)
    text, ids = Text(tokenizer), pieces(tokenizer, rng)
    n = 0
    while n < len(ids):
        n = min(len(ids), n + rng.choice((1, 1, 2, 5)))
        assert text(ids[:n]) == tokenizer.decode(ids[:n], skip_special_tokens=True)


def test_changed_prefix_starts_again(tokenizer):
    rng = random.Random(1)
    text, a, b = Text(tokenizer), pieces(tokenizer, rng), pieces(tokenizer, rng)
    text(a)
    for ids in (b, a[: len(a) // 2], a[:0]):
        assert text(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_tokenizer_with_clean_up_decodes_whole(tokenizer, monkeypatch):
    class Other:  # not byte-level: plain decode, every time
        calls = []

        def decode(self, ids, skip_special_tokens=False):
            self.calls.append(list(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    other = Other()
    assert not byte_level(other)
    text = Text(other)
    ids = tokenizer("a b c", add_special_tokens=False).input_ids
    assert text(ids) == tokenizer.decode(ids, skip_special_tokens=True) and other.calls == [ids]
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", True,
                        raising=False)
    from clover.server import choice

    monkeypatch.setattr(choice, "_BYTE_LEVEL", choice.weakref.WeakKeyDictionary())
    assert not byte_level(tokenizer)


def test_choice_streams_the_whole_text(tokenizer):
    rng = random.Random(3)
    ids = pieces(tokenizer, rng)
    choice, sent = Choice(tokenizer, [], False), ""
    for n in range(1, len(ids) + 1):
        choice.update(ids[:n], "length" if n == len(ids) else None)
        sent += choice.deltas()[1]
    assert sent == tokenizer.decode(ids, skip_special_tokens=True)


def test_wrapped_or_subclassed_decode_is_honoured(tokenizer):
    class Wrapper:  # exposes the fast tokenizer's backend, but decodes its own way
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def decode(self, ids, **kw):
            return "x" * len(ids)

    assert not byte_level(Wrapper()) and Text(Wrapper())([5, 6, 7]) == "xxx"
