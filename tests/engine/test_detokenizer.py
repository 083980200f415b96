"""Incremental detokenization: never broken UTF-8; stop strings never emitted, also when a
stop string arrives split across tokens."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from servelm.engine.detokenizer import IncrementalDetokenizer


class _Tok:
    """A byte-level tokenizer with one token per byte: multi-byte characters always split."""

    def __init__(self):
        vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self.backend = tok

    def encode(self, text):
        return self.backend.encode(text).ids


@pytest.fixture
def tok():
    return _Tok()


def _run(tok, text, stop=()):
    d = IncrementalDetokenizer(tok, [], list(stop))
    pieces, stopped = [], False
    for t in tok.encode(text):
        m = d.add_token(t)
        pieces.append(m.text)
        if m.stopped:
            stopped = True
            break
    if not stopped:
        pieces.append(d.flush())
    return pieces, stopped


def test_multibyte_characters_are_never_split(tok):
    text = "héllo 世界 🎉 naïve"
    pieces, _ = _run(tok, text)
    assert "".join(pieces) == text
    for p in pieces:
        p.encode("utf-8")  # would raise on a lone surrogate
        assert "\ufffd" not in p


def test_stop_string_split_across_tokens_is_not_emitted(tok):
    pieces, stopped = _run(tok, "The answer is 42. END of text", stop=["END"])
    assert stopped
    assert "".join(pieces) == "The answer is 42. "
    assert all("E" not in p for p in pieces[-3:]) or "END" not in "".join(pieces)


def test_partial_stop_prefix_is_released_when_it_does_not_complete(tok):
    pieces, stopped = _run(tok, "an ENd but not END-less", stop=["END-"])
    assert stopped
    assert "".join(pieces) == "an ENd but not "


def test_earliest_of_several_stop_strings_wins(tok):
    pieces, stopped = _run(tok, "abc xyz def", stop=["def", "xyz"])
    assert stopped and "".join(pieces) == "abc "


def test_stop_check_can_be_deferred(tok):
    d = IncrementalDetokenizer(tok, [], ["b"])
    ids = tok.encode("abc")
    assert d.add_token(ids[0], check_stop=False).text == "a"
    assert d.add_token(ids[1], check_stop=False).text == "b"
    assert d.add_token(ids[2]).text == "c"
