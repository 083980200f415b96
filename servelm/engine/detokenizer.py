"""Incremental detokenization and stop strings, per sequence.

Owns: turning a growing list of token ids into text deltas that never split a multi-byte
character (tokenizers' DecodeStream buffers incomplete UTF-8), and holding back text that may
be the start of a stop string, so a stop string is never emitted, even when it arrives split
across several tokens. Never: tensors.
"""

from __future__ import annotations

from typing import NamedTuple

from tokenizers.decoders import DecodeStream

# Prompt tokens given to DecodeStream as context: some decoders (SentencePiece's leading
# space, byte fallback) render a token differently at the start of a text.
_CONTEXT_TOKENS = 4


class StopMatch(NamedTuple):
    text: str  # the delta to emit
    stopped: bool  # a stop string was found; text ends right before it


class IncrementalDetokenizer:
    """Feed token ids one at a time; get back text safe to show."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True):
        self._backend = tokenizer.backend
        self._stream = DecodeStream(ids=prompt_token_ids[-_CONTEXT_TOKENS:],
                                    skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self.text = ""  # everything decoded so far (for stop-string search)
        self._num_emitted = 0  # characters of self.text already returned

    def add_token(self, token_id: int, check_stop: bool = True) -> StopMatch:
        """check_stop=False (before min_tokens is reached) lets stop strings through."""
        piece = self._stream.step(self._backend, token_id)
        if piece:
            self.text += piece
        if not self._stop or not check_stop:
            return self._emit(len(self.text), stopped=False)
        # Emitted text never ends in a stop-string prefix, so a stop can only begin in
        # the held-back tail.
        cut = _find_first(self.text, self._stop, self._num_emitted)
        if cut is not None:
            self.text = self.text[:cut]
            return self._emit(cut, stopped=True)
        return self._emit(len(self.text) - _partial_stop_len(self.text, self._stop), False)

    def flush(self) -> str:
        """Text held back for a possible stop string, once the sequence ends otherwise."""
        return self._emit(len(self.text), stopped=False).text

    def _emit(self, upto: int, stopped: bool) -> StopMatch:
        upto = max(upto, self._num_emitted)
        delta = self.text[self._num_emitted:upto]
        self._num_emitted = upto
        return StopMatch(delta, stopped)


def _find_first(text: str, stops: list[str], start: int) -> int | None:
    best = None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best is None or i < best):
            best = i
    return best


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
