"""The step contract: a runner that knows sequences only through StepDescription deltas
holds exactly the engine's view of every sequence it computes, under preemption, prefix-cache
hits, chunked prefill, speculative rollback and aborts; and a step costs O(new tokens) on the
wire, not O(context)."""

from __future__ import annotations

import random

from fake_runner import FakeRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.config import SchedulerConfig
from servelm.core import codec
from servelm.core.contract import SampledToken, SpecOutcome, StepResult
from servelm.engine.block_manager import BlockManager
from servelm.engine.engine import Engine
from servelm.protocol import EngineRequest, SamplingParams
from servelm.spec import SpecController

VOCAB = 1000


class ShadowRunner(FakeRunner):
    """Checks its own state against the engine's Sequences (which a real runner never sees)
    after every step's deltas are applied; speculates with random acceptance."""

    def __init__(self, seed: int):
        super().__init__(VOCAB, block_size=4)
        self.engine = None
        self.rng = random.Random(seed)
        self.num_checked = 0
        self.wire_bytes: list[int] = []

    def execute(self, step):
        self.wire_bytes.append(len(codec.frame(step)))
        step = codec.step_decoder.decode(codec.frame(step)[codec.HEADER_BYTES:])  # as a worker would
        out = StepResult([])
        for s in self.state.apply(step):
            mine, theirs = s.seq, self.engine._seqs[s.seq.seq_id]
            assert mine.token_ids == theirs.token_ids
            assert mine.block_table == theirs.block_table
            assert s.start == theirs.num_computed_tokens
            assert mine.params == theirs.params and mine.seed == theirs.seed
            self.num_checked += 1
            self.check_slots(s)
            if s.num_spec:
                m = self.rng.randint(0, s.num_spec)
                accepted = self.rng.randint(0, m)
                ctx = list(mine.token_ids)
                emitted = []
                for _ in range(accepted + 1):
                    emitted.append(self.next_token(ctx))
                    ctx.append(emitted[-1])
                if m:
                    out.spec[mine.seq_id] = SpecOutcome(m, accepted)
                out.sampled += [SampledToken(mine.seq_id, t) for t in emitted]
            elif s.is_sampling:
                out.sampled.append(SampledToken(mine.seq_id, self.next_token(mine.token_ids)))
        # The runner forgets exactly the sequences the engine no longer has.
        assert set(self.state.seqs) <= set(self.engine._seqs) | set(step.finished_seq_ids)
        return out


def _engine(runner, num_blocks, budget, spec, prefix, max_num_seqs=6, max_model_len=256):
    engine = Engine(runner, None, BlockManager(num_blocks, 4, prefix),
                    SchedulerConfig(budget, max_num_seqs, True), max_model_len, VOCAB, (1,),
                    speculator=SpecController(3, adaptive=False) if spec else None)
    runner.engine = engine
    return engine


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), num_blocks=st.integers(18, 40), budget=st.integers(4, 48),
       spec=st.booleans(), prefix=st.booleans(),
       prompts=st.lists(st.integers(1, 40), min_size=1, max_size=8),
       aborts=st.lists(st.integers(1, 30), max_size=3))
def test_runner_state_built_from_deltas_matches_the_engine(seed, num_blocks, budget, spec,
                                                            prefix, prompts, aborts):
    runner = ShadowRunner(seed)
    engine = _engine(runner, num_blocks, budget, spec, prefix)
    rng = random.Random(seed)
    shared = [rng.randrange(10, VOCAB) for _ in range(12)]  # a common prefix for cache hits
    reqs = []
    for i, n in enumerate(prompts):
        ids = (shared[:rng.randint(0, 12)] + [rng.randrange(10, VOCAB) for _ in range(n)])[:40]
        p = SamplingParams(max_tokens=rng.randint(1, 24), n=rng.choice([1, 1, 2]),
                           temperature=0, ignore_eos=True, seed=rng.choice([None, 7]))
        reqs.append(EngineRequest(f"r{i}", ids, p))
        engine.add_request(reqs[-1])
    step = 0
    while engine.has_unfinished:
        engine.step()
        step += 1
        if step in aborts:
            engine.abort(reqs[step % len(reqs)].request_id)
        engine.check_invariants()
        assert step < 5000
    assert runner.num_checked > 0
    engine.step()  # nothing left: a last (empty) step carries no sequence
    assert not engine._views


def test_a_decode_step_costs_the_same_bytes_at_any_context_length():
    """Deltas, not whole block tables or token lists: the wire size of a decode step does
    not grow with the context (here 16 sequences from 200 to 900 tokens)."""
    runner = ShadowRunner(0)
    engine = _engine(runner, 4096, 4096, False, False, max_num_seqs=16, max_model_len=1024)
    for i in range(16):
        engine.add_request(EngineRequest(f"r{i}", [10 + i] * 200,
                                         SamplingParams(max_tokens=700, ignore_eos=True)))
    while engine.has_unfinished:
        engine.step()
    decode = runner.wire_bytes[2:]  # after the prefill steps
    early, late = decode[10:110], decode[-110:-10]
    assert len(decode) > 600
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    # ~15 bytes a sequence (id, start, one token, counts, a block id every 4th step) early
    # and late; a whole block table would be ~450 bytes a sequence at 900 tokens.
    assert mean(late) <= mean(early) * 1.1
    assert mean(late) < 16 * 20
