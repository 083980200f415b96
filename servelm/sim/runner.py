"""SimRunner: the Runner protocol without a model.

Owns: what it needs of each sequence from the StepDescriptions' deltas (how many tokens
it has been sent, and its token offset below; a model's runner keeps a RunnerState with
the tokens and blocks themselves, which nothing here reads), synthetic sampled tokens, and
the step's time from a StepCostModel, spent by advancing the replica's virtual clock.
Never: imports torch, or decides anything the scheduler decides.

KV block moves (StepDescription.kv_saves / kv_loads): there are no contents to move, so a
save comes back as a KVBlock with empty data and a load is accepted as it is; what a move
costs in time is the caller's to model (a transfer or tier bandwidth), not the step's.

Tokens: position p of a sequence holds entry (p + offset) of a fixed pseudo-random table of
non-EOS ids (the offset from the prompt's length and last token), so a request ends exactly
at its max_tokens (the workload's output length), as `ignore_eos` requests do on a server,
and the simulator's bulk steps can take a run of tokens as one slice (`tokens`).
"""

from __future__ import annotations

import functools
import random

from servelm.core.contract import KVBlock, SampledToken, StepDescription, StepResult
from servelm.engine.step_cost_model import StepCostModel, StepShape, step_shape

_PERIOD = 8192  # synthetic tokens repeat after this many positions


@functools.lru_cache(maxsize=8)
def _token_table(vocab_size: int, eos: frozenset) -> list[int]:
    """Two copies of one pseudo-random period of non-EOS ids (a run of tokens is one slice,
    across the wrap too); shared by every replica of a fleet, never written."""
    rng = random.Random(vocab_size)
    ids = [t for t in range(min(100, vocab_size // 2), vocab_size) if t not in eos]
    table = [rng.choice(ids) for _ in range(_PERIOD)]
    return table + table


def _offset(token_ids: list[int], num_prompt_tokens: int) -> int:
    """Where a sequence's tokens start in the table: from its prompt's length and last id."""
    p = num_prompt_tokens
    return (token_ids[p - 1] * 7919 + p * 104729) % _PERIOD


class VirtualClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class SimRunner:
    def __init__(self, cost: StepCostModel, clock: VirtualClock, vocab_size: int = 49152,
                 eos_token_ids: tuple[int, ...] = ()):
        self.cost = cost
        self.clock = clock
        self.vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self._table = _token_table(vocab_size, self.eos)
        # seq_id -> [tokens sent so far, offset]: a sequence as RunnerState would hold it,
        # less the copies of its tokens and block table
        self._seqs: dict[int, list[int]] = {}
        self.num_steps = 0
        self.busy_s = 0.0
        # (decodes, context tokens) the step also runs that its description leaves out:
        # the decode head's decodes (servelm/sim/bulk.py mixed_step); None: none.
        self.hidden: tuple[int, int] | None = None

    def execute(self, step: StepDescription) -> StepResult:
        sampled = self._apply(step)
        shape = step_shape(step)
        if self.hidden is not None:
            k, ctx = self.hidden
            shape = StepShape(shape.num_seqs + k, shape.num_decode_tokens + k,
                              shape.num_decode_context_tokens + ctx, shape.num_prefill_tokens,
                              shape.num_prefill_pairs)
        step_s = self.cost.predict(shape)
        self.clock.now += step_s
        self.num_steps += 1
        self.busy_s += step_s
        table = self._table
        out = [SampledToken(seq_id, table[pos % _PERIOD]) for seq_id, pos in sampled]
        kv_saved = [KVBlock(b, b"") for b in step.kv_saves]
        return StepResult(out, forward_s=step_s, kv_saved=kv_saved)

    def _apply(self, step: StepDescription) -> list[tuple[int, int]]:
        """The step's deltas applied as RunnerState.apply would (a preempted sequence
        keeps its tokens); returns (seq_id, its tokens + offset) of each sequence the step
        samples for (RunnerScheduled.is_sampling: it reaches the last token)."""
        seqs = self._seqs
        for seq_id in step.finished_seq_ids:
            seqs.pop(seq_id, None)
        sampled = []
        for s in step.seqs:
            st = seqs.get(s.seq_id)
            if st is None:
                if s.new is None:
                    raise ValueError(f"step {step.step_id} schedules sequence {s.seq_id}, "
                                     "which this runner has never seen")
                p = s.new.num_prompt_tokens  # on first sight it is sent every token
                st = seqs[s.seq_id] = [0, _offset(s.new_token_ids, p)]
            n = st[0] = st[0] + len(s.new_token_ids)
            if s.start + s.num_new_tokens - s.num_spec == n:
                sampled.append((s.seq_id, n + st[1]))
        return sampled

    def _token(self, seq) -> int:
        """The next token of `seq` (anything holding token_ids and num_prompt_tokens)."""
        return self._table[(len(seq.token_ids) + _offset(seq.token_ids,
                                                         seq.num_prompt_tokens)) % _PERIOD]

    def tokens(self, seq, n: int) -> list[int]:
        """The next n tokens of `seq`, as n steps of _token would append them."""
        out: list[int] = []
        pos = len(seq.token_ids) + _offset(seq.token_ids, seq.num_prompt_tokens)
        while len(out) < n:
            start = (pos + len(out)) % _PERIOD
            out += self._table[start:start + min(n - len(out), _PERIOD)]
        return out


__all__ = ["SimRunner", "VirtualClock"]
