"""Property tests (hypothesis): speculative steps with any mix of accepted and rejected
drafts, under preemption, chunking, prefix caching and aborts, leave no block leaked, stale
or double-freed, and emit exactly the tokens plain decoding emits.

The fake target's next token is a hash of the sequence so far (as greedy decoding of a real
model); the fake proposer guesses the true continuation or a wrong token at random.
"""

import random

from fake_runner import FakeRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from servelm.config import SchedulerConfig
from servelm.engine.block_manager import BlockManager
from servelm.engine.engine import Engine
from servelm.protocol import EngineRequest, InvalidParameterError, SamplingParams
from servelm.core.contract import SampledToken, SpecOutcome, StepResult
from servelm.spec import SpecController

VOCAB = 1000


def _next(tokens):
    return hash(tuple(tokens)) % (VOCAB - 10) + 10


class FakeSpecRunner(FakeRunner):
    def __init__(self, seed, hit_rate):
        super().__init__(VOCAB, block_size=4)
        self.rng = random.Random(seed)
        self.hit_rate = hit_rate

    def execute(self, step):
        out = StepResult([])
        for s in self.state.apply(step):
            seq = s.seq
            self.check_slots(s)  # the draft slots exist in the block table
            if s.num_spec:
                m = self.rng.randint(0, s.num_spec)
                truth, ctx = [], list(seq.token_ids)
                for _ in range(m + 1):
                    truth.append(_next(ctx))
                    ctx.append(truth[-1])
                drafts = [t if self.rng.random() < self.hit_rate else 7 for t in truth[:m]]
                emitted = []
                for d, t in zip(drafts, truth):
                    if d != t:
                        break
                    emitted.append(d)
                emitted.append(truth[len(emitted)])
                if m:
                    out.spec[seq.seq_id] = SpecOutcome(m, len(emitted) - 1)
                out.sampled += [SampledToken(seq.seq_id, t) for t in emitted]
            elif s.is_sampling:
                out.sampled.append(SampledToken(seq.seq_id, _next(seq.token_ids)))
        return out


def _engine(runner, num_blocks, budget, spec, prefix=True):
    return Engine(runner, None, BlockManager(num_blocks, 4, prefix),
                  SchedulerConfig(budget, 8, True), 512, VOCAB, (1,),
                  speculator=SpecController(3, adaptive=False) if spec else None)


def _run_all(engine, requests, aborts=()):
    outputs = {}
    for r in requests:
        engine.add_request(r)
    step = 0
    while engine.has_unfinished:
        for d in engine.step():
            outputs.setdefault(d.request_id, []).extend(d.token_ids)
        step += 1
        if step in aborts:
            engine.abort(requests[step % len(requests)].request_id)
        engine.check_invariants()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return outputs


_req = st.tuples(st.integers(1, 40), st.integers(1, 30), st.integers(0, 3))


@settings(max_examples=120, deadline=None)
@given(reqs=st.lists(_req, min_size=1, max_size=8), num_blocks=st.integers(26, 80),
       budget=st.integers(2, 40), seed=st.integers(0, 1000), hit=st.floats(0, 1),
       prefix=st.booleans())
def test_speculation_keeps_output_and_blocks(reqs, num_blocks, budget, seed, hit, prefix):
    requests = []
    for i, (plen, max_tokens, shared) in enumerate(reqs):
        # Shared starts make prefix-cache hits (and shared blocks) likely.
        prompt = [3 + shared] * min(plen, 9) + list(range(20 + i, 20 + i + max(0, plen - 9)))
        requests.append(EngineRequest(f"r{i}", prompt,
                                      SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    try:
        plain = _run_all(_engine(FakeRunner(VOCAB), num_blocks, budget, False, prefix),
                         requests)
    except InvalidParameterError:
        return  # does not fit the pool at all: rejected at admission either way
    spec = _run_all(_engine(FakeSpecRunner(seed, hit), num_blocks, budget, True, prefix),
                    requests)
    assert spec == plain


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 1000), aborts=st.sets(st.integers(1, 30), max_size=5))
def test_aborts_mid_speculation_free_everything(seed, aborts):
    requests = [EngineRequest(f"a{i}", [5, 6, 7, 8, 9][: i + 1] * 3,
                              SamplingParams(max_tokens=20, ignore_eos=True))
                for i in range(5)]
    _run_all(_engine(FakeSpecRunner(seed, 0.7), 30, 16, True), requests, aborts)
