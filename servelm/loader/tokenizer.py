"""The one tokenizer type the server and engine see, whatever file it came from.

Owns: `Tokenizer`, a thin wrapper over a `tokenizers.Tokenizer` (`.backend`) plus what a
server needs next to it: BOS/EOS ids, the end-of-generation set, special-token checks and the
chat template. The loaders (`hf_loader`, `gguf_loader`) build the backend; this module only
wraps it.

Never: reads model files, or decides BOS by itself: whether `encode()` adds a BOS is decided
by the backend's post-processor, which each loader sets to match the original HF tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache

import tokenizers
from tokenizers import decoders

from servelm.loader.chat_template import render_chat_template
from servelm.protocol import InvalidParameterError

__all__ = ["END_OF_GENERATION_TOKENS", "Tokenizer", "end_of_generation_ids"]

# Tokens that end a turn, matched by name as llama.cpp does: many models declare only one EOS
# id, yet their chat templates close every turn with another of these.
END_OF_GENERATION_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|end|>",
    "</s>",
    "<end_of_turn>",
)


def end_of_generation_ids(
    eos_ids: Iterable[int | None], lookup: Callable[[str], int | None]
) -> tuple[int, ...]:
    """Declared EOS ids first, then the end-of-generation tokens `lookup` finds; no repeats."""
    found: list[int] = [int(i) for i in eos_ids if i is not None]
    for name in END_OF_GENERATION_TOKENS:
        token_id = lookup(name)
        if token_id is not None:
            found.append(int(token_id))
    return tuple(dict.fromkeys(found))


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the
    others are shifted to code points from 256 (so a space is 'Ġ')."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in kept:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """Text <-> token ids, with the special tokens and chat template of one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added_tokens = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(
            token_id for token_id, added in added_tokens.items() if added.special
        )
        self._added_text = {token_id: added.content for token_id, added in added_tokens.items()}
        self._is_byte_level = isinstance(backend.decoder, decoders.ByteLevel)

    @property
    def eos_token_id(self) -> int | None:
        """The model's declared EOS (first of `eos_token_ids`)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Raw vocabulary strings (byte-level BPE spells a space as 'Ġ'), for logprobs."""
        return [self.backend.id_to_token(int(i)) or "" for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for. A token holding part of a multi-byte character
        gives its own bytes (decoding it alone would give U+FFFD's): what the `bytes` of
        OpenAI's logprobs are for, so a client can join tokens into exact text."""
        added = self._added_text.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        piece = self.backend.id_to_token(int(token_id)) or ""
        if self._is_byte_level:
            table = _byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        else:
            m = _BYTE_FALLBACK.fullmatch(piece)
            if m:  # SentencePiece byte fallback
                return bytes([int(m.group(1), 16)])
            if "▁" in piece:
                return piece.replace("▁", " ").encode("utf-8")
        return self.backend.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra) -> str:
        """The prompt string for a chat; bad messages raise InvalidParameterError. `extra`
        goes to the template as variables (`tools`, as transformers passes them)."""
        if self.chat_template is None:
            # A base model: the request, not the server, must change.
            raise InvalidParameterError(
                "this model has no chat template; send a plain prompt to the completions API",
                param="messages",
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
            **extra,
        )

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, chat_template={self.chat_template is not None})"
        )
