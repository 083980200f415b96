"""Property tests (hypothesis) of the block manager, scheduler and engine bookkeeping:
no block leaked or double-freed, free + used == total after any sequence of add/step/abort."""

from hypothesis import given, settings
from hypothesis import strategies as st

from fake_runner import make_engine
from servelm.engine.block_manager import BlockManager
from servelm.engine.sequence import Sequence
from servelm.protocol import (EngineRequest, InvalidParameterError, RequestTimings,
                              SamplingParams)

import pytest


@given(st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5),
                          st.integers(1, 40)), max_size=60))
def test_block_manager_never_leaks(ops):
    bm = BlockManager(num_blocks=24, block_size=4)
    seqs = [Sequence("r", i, [1] * 3, SamplingParams(), RequestTimings(), 8) for i in range(6)]
    for op, i, n in ops:
        seq = seqs[i]
        if op == "alloc":
            if bm.can_allocate(seq, n):
                bm.allocate(seq, n)
                seq.num_computed_tokens += n
                assert len(seq.block_table) == bm.blocks_for_tokens(seq.num_computed_tokens)
        else:
            bm.free(seq)
            seq.num_computed_tokens = 0
        bm.check_invariants(seqs)
        assert bm.num_free_blocks + sum(len(s.block_table) for s in seqs) == bm.num_blocks


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = Sequence("r", 0, [1, 2], SamplingParams(), RequestTimings(), 4)
    bm.allocate(seq, 2)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(seq)


_request = st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(1, 3))
_op = st.one_of(
    st.tuples(st.just("add"), _request),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_op, max_size=40), num_blocks=st.integers(24, 80),
       budget=st.integers(1, 48), chunked=st.booleans())
def test_engine_bookkeeping_holds_under_any_schedule(ops, num_blocks, budget, chunked):
    engine = make_engine(num_blocks=num_blocks, max_num_batched_tokens=budget if chunked
                         else 64, chunked=chunked)
    added, outputs = [], {}
    for op, arg in ops:
        if op == "add":
            prompt_len, max_tokens, n = arg
            rid = f"r{len(added)}"
            req = EngineRequest(rid, list(range(5, 5 + prompt_len)),
                                SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True))
            try:
                engine.add_request(req)
            except InvalidParameterError:  # can never fit: rejected at once, nothing queued
                assert not any(s.request_id == rid for s in engine.scheduler.live_sequences())
                continue
            added.append(rid)
        elif op == "step":
            for _ in range(arg):
                _collect(engine.step(), outputs)
        elif added:
            engine.abort(added[arg % len(added)])
        engine.check_invariants()
    while engine.has_unfinished:
        _collect(engine.step(), outputs)
        engine.check_invariants()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    for rid in added:  # every request ended exactly once per choice
        assert rid in outputs


def _collect(deltas, outputs):
    for d in deltas:
        if d.finish_reason is not None:
            key = (d.request_id, d.index)
            assert key not in outputs.get(d.request_id, set()), "finished twice"
            outputs.setdefault(d.request_id, set()).add(key)


def test_length_finish_counts_exact_tokens():
    engine = make_engine()
    engine.add_request(EngineRequest("a", [5, 6, 7], SamplingParams(max_tokens=9,
                                                                     ignore_eos=True)))
    tokens, reason = [], None
    while engine.has_unfinished:
        for d in engine.step():
            tokens += d.token_ids
            reason = d.finish_reason or reason
    assert len(tokens) == 9 and reason.value == "length"


def test_preempted_sequence_resumes_with_its_tokens():
    # 6 blocks of 4 tokens: two sequences growing to 20 tokens cannot both stay resident.
    engine = make_engine(num_blocks=6, max_num_batched_tokens=64)
    ref = make_engine(num_blocks=64, max_num_batched_tokens=64)
    outs = {}
    for e, key in ((engine, "tight"), (ref, "roomy")):
        for rid in ("a", "b"):
            e.add_request(EngineRequest(rid, [3, 4, 5, 6], SamplingParams(max_tokens=16,
                                                                          ignore_eos=True)))
        got = {"a": [], "b": []}
        while e.has_unfinished:
            for d in e.step():
                got[d.request_id] += d.token_ids
        outs[key] = got
    assert engine.scheduler.num_preemptions > 0
    assert outs["tight"] == outs["roomy"]
