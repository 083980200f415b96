"""GrammarMasks: the allowed tokens of each structured sequence, step by step (runner side).

Owns: one llguidance matcher per sequence with a StructuredOutput, advanced by the tokens the
sequence really has (so a preemption, a rejected draft or a chunked prefill never leaves it
out of step), and each step's masks: one row for the next token, plus one per draft token of
a speculating sequence (the mask after the drafts before it), so verification scores the
drafts against the masked distribution and a draft the grammar forbids is rejected.
The masks are computed on a worker thread while the model runs (llguidance releases the GIL).
Never: decides which token is sampled, or changes a sequence's tokens.

    step:  start(items) --------- forward pass --------- result() -> {seq_id: [1 + drafts, V]}
                 \\__ worker: sync matchers, fill bitmasks __/
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)


@dataclass
class _SeqMatcher:
    matcher: object | None  # llguidance.LLMatcher; None: the grammar did not compile
    num_consumed: int = 0  # output tokens fed to it


class GrammarMasks:
    def __init__(self, compiler):
        self.compiler = compiler  # servelm.structured.GrammarCompiler
        self.vocab_size = compiler.vocab_size
        self._seqs: dict[int, _SeqMatcher] = {}
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._executor = None  # llguidance.LLExecutor, built on first use

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def start(self, items: list[tuple]) -> Future | None:
        """items: (RunnerSequence, drafts) of the sequences sampling this step; the masks of
        those with a StructuredOutput, computed off this thread (None: there are none)."""
        wanted = [(seq, list(drafts)) for seq, drafts in items
                  if seq.params.structured is not None]
        if not wanted:
            return None
        return self._worker.submit(self.masks, wanted)

    def masks(self, wanted: list[tuple]) -> dict[int, np.ndarray]:
        """{seq_id: allowed [1 + len(drafts), V] bool (numpy, on the host)}: row 0 for the
        token after the sequence's last, row i for the token after its first i drafts."""
        import llguidance.numpy as lln

        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        num_rows = sum(1 + len(d) for _, d in wanted)
        words = (self.vocab_size + 31) // 32
        # -1: all allowed, for rows after a draft the grammar rejects (never used: that
        # draft is rejected and the token there is drawn from the row before it).
        bitmask = np.full((num_rows, words), -1, dtype=np.int32)
        plain, drafted, broken, at = [], [], [], 0
        for seq, drafts in wanted:
            matcher = self._sync(seq)
            if matcher is None:
                broken.append(at)
            elif drafts:
                drafted.append((matcher, at, drafts))
            else:
                plain.append((matcher, at))
            at += 1 + len(drafts)
        if plain:
            lln.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:
            lln.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)
        # Bit j of word w is token 32 w + j (little-endian words). numpy, not tensor ops:
        # these small ops cost milliseconds each in torch on a loaded CPU, microseconds here.
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = bits[:, :self.vocab_size].astype(bool)
        for row in broken:
            allowed[row] = False
        # A matcher in error (or a grammar that did not compile) allows nothing: end the
        # sequence with EOS rather than sample from an empty set.
        for row in np.flatnonzero(~allowed.any(axis=1)):
            allowed[row, self.compiler.eos_token_ids] = True
        out, at = {}, 0
        for seq, drafts in wanted:
            out[seq.seq_id] = allowed[at:at + 1 + len(drafts)]
            at += 1 + len(drafts)
        return out

    def _sync(self, seq):
        """The sequence's matcher, fed every output token it has not seen yet."""
        state = self._seqs.get(seq.seq_id)
        if state is None:
            try:
                matcher = self.compiler.matcher(seq.params.structured)
            except ValueError as exc:  # the front end checks; the Python API may not
                logger.warning("sequence %d: %s", seq.seq_id, exc)
                matcher = None
            state = self._seqs[seq.seq_id] = _SeqMatcher(matcher)
        new = seq.token_ids[seq.num_prompt_tokens + state.num_consumed:]
        if new and state.matcher is not None:
            if not state.matcher.consume_tokens(new):
                logger.warning("sequence %d left its grammar: %s", seq.seq_id,
                               state.matcher.get_error())
        state.num_consumed += len(new)
        return state.matcher


__all__ = ["GrammarMasks"]
