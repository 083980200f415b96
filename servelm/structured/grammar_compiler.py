"""GrammarCompiler: StructuredOutput -> a compiled llguidance grammar, once per spec.

Owns: the llguidance tokenizer of one model (built lazily: about half a second), turning a
StructuredOutput into llguidance's grammar text, checking it compiles against the
vocabulary (InvalidParameterError naming the request field otherwise), and a bounded cache
of both, so a schema sent with every request is compiled once.
Never: touches tensors or sequences (that is GrammarMasks), or reads engine state.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict

from servelm.protocol import InvalidParameterError, StructuredOutput

# Compiled grammars kept per compiler (each is a few KB of text plus llguidance's caches).
MAX_CACHED_GRAMMARS = 256

_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer, vocab_size: int, eos_token_ids) -> GrammarCompiler:
    """The one compiler of a tokenizer (the server and an in-process runner share it)."""
    with _COMPILERS_LOCK:
        comp = _COMPILERS.get(tokenizer)
        if comp is None or comp.vocab_size != vocab_size:
            comp = _COMPILERS[tokenizer] = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        return comp


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        """tokenizer: servelm's Tokenizer (its `.backend` is a `tokenizers.Tokenizer`);
        vocab_size: the model's logits width (may exceed the tokenizer's)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._ll_tokenizer = None
        self._grammars: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._matchers: OrderedDict[StructuredOutput, object] = OrderedDict()  # never advanced
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                backend = self._tokenizer.backend
                self._ll_tokenizer = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    def grammar(self, so: StructuredOutput) -> str:
        """The compiled grammar of `so`; raises InvalidParameterError naming `so.param` when
        the spec is malformed or the library cannot compile it."""
        with self._lock:
            cached = self._grammars.get(so)
            if cached is not None:
                self._grammars.move_to_end(so)
                return cached
        text = self._check(so, _grammar_text(so))
        with self._lock:
            self._grammars[so] = text
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return text

    def matcher(self, so: StructuredOutput):
        """A fresh llguidance matcher at the start of the output: a copy of one built once
        per spec (building one parses the grammar again, ~3 ms for a small schema; a copy
        takes microseconds)."""
        import llguidance

        with self._lock:
            pristine = self._matchers.get(so)
            if pristine is not None:
                self._matchers.move_to_end(so)
        if pristine is None:
            pristine = llguidance.LLMatcher(self.ll_tokenizer, self.grammar(so), log_level=0)
            with self._lock:
                self._matchers[so] = pristine
                while len(self._matchers) > MAX_CACHED_GRAMMARS:
                    self._matchers.popitem(last=False)
        return pristine.deep_copy()

    def _check(self, so: StructuredOutput, text: str) -> str:
        import llguidance

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.ll_tokenizer)
        if is_error:
            raise InvalidParameterError(
                f"{so.param}: cannot compile the {so.kind}: {_first_line(messages[0])}",
                param=so.param, code="invalid_grammar")
        return text


def _grammar_text(so: StructuredOutput) -> str:
    import llguidance

    def bad(why: str) -> InvalidParameterError:
        return InvalidParameterError(f"{so.param}: {why}", param=so.param,
                                     code="invalid_grammar")

    try:
        if so.kind == "json_schema":
            schema = json.loads(so.spec)
            if not isinstance(schema, (dict, bool)):
                raise bad("the JSON schema must be an object")
            if isinstance(schema, dict) and not so.strict:
                schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}),
                                                   "lenient": True}}
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        if so.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(so.spec)
        if so.kind == "choice":
            choices = json.loads(so.spec)
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise bad("choice must be a non-empty list of non-empty strings")
            return llguidance.grammar_from("choice", choices)
        syntax = "ebnf" if "::=" in so.spec else "lark"
        return llguidance.grammar_from(syntax, so.spec)
    except InvalidParameterError:
        raise
    except json.JSONDecodeError as exc:
        raise bad(f"not valid JSON: {exc}") from None
    except (ValueError, RuntimeError, TypeError) as exc:
        raise bad(f"cannot compile the {so.kind}: {_first_line(str(exc))}") from None


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:500] if message.strip() else "invalid"


__all__ = ["MAX_CACHED_GRAMMARS", "GrammarCompiler", "compiler_for"]
