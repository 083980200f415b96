"""The SLO spec (servelm/slo.py) and the SLO scheduling policy (servelm/engine/slo_policy.py):
the spec file and its errors, class resolution from a request's priority / slo_class, the
sliding goodput window, and the policy's order, chunk cap and early refusal in the real
Scheduler, with the engine's bookkeeping invariants holding under any schedule (hypothesis)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fake_runner import make_engine
from test_engine_properties import _collect
from servelm.engine.slo_policy import SLOPolicy, SLOUnattainableError
from servelm.protocol import EngineRequest, InvalidParameterError, SamplingParams
from servelm.slo import (SLOSpec, SLOSpecError, SlidingGoodput, assign_classes,
                         parse_class_mix, spec_from_flags)

SPEC = {"classes": [
    {"name": "interactive", "priority": 0, "ttft_ms": 200, "tpot_ms": 20, "percentile": 90},
    {"name": "batch", "priority": 1, "ttft_ms": 20000, "tpot_ms": 500, "percentile": 50,
     "reject_early": False}], "default_class": "batch", "window_s": 10}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _linear(base=0.01, per_token=0.001):
    """A step-time model: base + per token computed (decodes and prompt tokens alike)."""
    return lambda seqs, dec, ctx, pre, pairs: base + per_token * (dec + pre)


def _engine(clock, step_time=_linear(), **kw):
    engine = make_engine(**kw)
    engine.clock = clock  # the engine's timestamps and the policy's "now" on one clock
    engine.scheduler.policy = SLOPolicy(clock, step_time)
    return engine


def _req(rid, n_prompt, cls, spec, max_tokens=4, arrival=0.0):
    return EngineRequest(rid, list(range(5, 5 + n_prompt)),
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         arrival_time=arrival, slo=spec.get(cls).request_slo())


# -- the spec ------------------------------------------------------------------------------

def test_spec_file_round_trips_and_resolves_classes(tmp_path):
    path = tmp_path / "slo.json"
    path.write_text(json.dumps(SPEC))
    spec = SLOSpec.load(path)
    assert spec.names == ["interactive", "batch"] and spec.window_s == 10
    assert SLOSpec.from_dict(spec.to_dict()) == spec
    assert spec.resolve().name == "batch"  # the default class
    assert spec.resolve(priority=0).name == "interactive"
    assert spec.resolve(slo_class="interactive", priority=0).name == "interactive"
    slo = spec.get("interactive").request_slo()
    assert (slo.priority, slo.ttft_s, slo.tpot_s, slo.reject_early) == (0, 0.2, 0.02, True)
    assert spec_from_flags(str(path), 1, 2) == spec  # the file replaces the flags
    one = spec_from_flags(None, 1000, 100)
    assert one.names == ["default"] and one.get("default").ttft_s == 1.0


@pytest.mark.parametrize("priority, slo_class, param", [
    (7, None, "priority"), (None, "premium", "slo_class"), (1, "interactive", "priority")])
def test_a_request_naming_no_class_or_two_is_refused_by_field(priority, slo_class, param):
    spec = SLOSpec.from_dict(SPEC)
    with pytest.raises(InvalidParameterError) as e:
        spec.resolve(priority, slo_class)
    assert e.value.param == param


@pytest.mark.parametrize("patch, field", [
    ({"classes": []}, "classes"),
    ({"default_class": "x"}, "default_class"),
    ({"window_s": 0}, "window_s"),
    ({"colour": 1}, "colour"),
    ({"classes": [{"name": "a", "ttft_ms": 1}]}, "tpot_ms"),
    ({"classes": [{"name": "a", "ttft_ms": -1, "tpot_ms": 1}]}, "ttft_ms"),
    ({"classes": [{"name": "a", "ttft_ms": 1, "tpot_ms": 1, "percentile": 120}]}, "percentile"),
    ({"classes": [{"name": "a", "ttft_ms": 1, "tpot_ms": 1},
                  {"name": "b", "ttft_ms": 1, "tpot_ms": 1}]}, "priority"),
])
def test_bad_spec_fields_are_named(patch, field):
    data = {**SPEC, **patch}
    if "classes" in patch and patch["classes"]:
        data["default_class"] = patch["classes"][0]["name"]
    with pytest.raises(SLOSpecError, match=field):
        SLOSpec.from_dict(data)


def test_sliding_goodput_forgets_what_left_the_window():
    g = SlidingGoodput(SLOSpec.from_dict(SPEC))  # window 10 s
    g.record("interactive", False, 0.0)
    g.record("interactive", True, 5.0)
    assert g.goodput("interactive", 6.0) == 0.5
    assert g.goodput("interactive", 10.5) == 1.0  # the miss at t=0 is out of the window
    assert g.goodput("interactive", 16.0) is None and g.goodput("batch", 1.0) is None


def test_class_mix_shares_and_errors():
    spec = SLOSpec.from_dict(SPEC)
    mix = parse_class_mix("interactive=3,batch=1", spec)
    assert mix == [("interactive", 0.75), ("batch", 0.25)]
    classes = assign_classes(4000, mix, seed=1)
    assert classes == assign_classes(4000, mix, seed=1)
    assert abs(classes.count("interactive") / 4000 - 0.75) < 0.03
    with pytest.raises(ValueError, match="--class-mix: 'gold'"):
        parse_class_mix("gold=1", spec)


# -- the policy in the scheduler -----------------------------------------------------------

def test_waiting_work_is_ordered_by_class_then_slack():
    spec = SLOSpec.from_dict(SPEC)
    clock = Clock()
    engine = _engine(clock, max_num_batched_tokens=8, max_num_seqs=1, num_blocks=64)
    # The first request fills the one running slot; the rest queue. (Interactive: an
    # interactive request would take a batch request's seat.)
    engine.add_request(_req("first", 4, "interactive", spec, max_tokens=30))
    engine.step()
    engine.add_request(_req("b-early", 4, "batch", spec, arrival=0.0))
    engine.add_request(_req("i-late", 4, "interactive", spec, arrival=0.002))
    engine.add_request(_req("i-early", 4, "interactive", spec, arrival=0.001))
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["i-early", "i-late", "b-early"]


def test_a_doomed_request_goes_behind_those_that_can_still_make_it():
    spec = SLOSpec.from_dict(SPEC)
    clock = Clock()
    engine = _engine(clock, max_num_batched_tokens=8, max_num_seqs=1, num_blocks=64)
    engine.add_request(_req("first", 4, "batch", spec, max_tokens=30))
    engine.step()
    clock.now = 0.5
    engine.add_request(_req("old", 4, "interactive", spec, arrival=0.01))  # 200 ms: missed
    engine.add_request(_req("new", 4, "interactive", spec, arrival=0.45))
    engine.add_request(_req("batch", 4, "batch", spec, arrival=0.01))
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["new", "batch", "old"]


def _four_decodes_and_a_long_prompt(spec, step_time=_linear(), max_tokens=2, long="batch",
                                    arrival=0.0):
    """Four interactive requests decoding (TPOT 20 ms; `max_tokens` each), a 40-token
    prompt of class `long` waiting. The TTFT-share cap is off (ttft_share inf): each test
    looks at one rule."""
    engine = _engine(Clock(), step_time, max_num_batched_tokens=64, max_num_seqs=8,
                     num_blocks=128)
    engine.scheduler.policy.min_chunk = 2
    engine.scheduler.policy.ttft_share = math.inf
    for i in range(4):
        engine.add_request(_req(f"i{i}", 4, "interactive", spec, max_tokens=max_tokens))
    engine.step()  # the four prompts
    engine.add_request(_req("long", 40, long, spec, max_tokens=4, arrival=arrival))
    return engine


def _long_tokens(batch) -> list[int]:
    return [s.num_new_tokens for s in batch.seqs if s.seq.request_id == "long"]


def test_prefill_chunks_are_capped_by_what_the_running_decodes_can_take():
    spec = SLOSpec.from_dict(SPEC)  # interactive TPOT 20 ms: steps within 0.9 x 20 = 18 ms
    # step = 10 ms + 1 ms per token. Decodes with one token left: their next step is their
    # last gap, so 4 decodes + c prompt tokens <= 18 ms -> c <= 4. (An interactive prompt:
    # a batch one waits for headroom beside them, test_background_headroom.py.)
    engine = _four_decodes_and_a_long_prompt(spec, long="interactive")
    assert _long_tokens(engine.scheduler.schedule()) == [4]
    assert engine.scheduler.policy.last_prefill_cap == 4  # not the 60 the budget allows
    # Two tokens left each: this step and one plain one (14 ms) share 2 x 18 ms, so this
    # one may take 22 ms: c <= 8. The faster-than-target steps after it pay for it.
    engine = _four_decodes_and_a_long_prompt(spec, max_tokens=3, long="interactive")
    assert _long_tokens(engine.scheduler.schedule()) == [8]
    # FCFS on the same state takes the whole prompt.
    fcfs = make_engine(max_num_batched_tokens=64, max_num_seqs=8, num_blocks=128)
    for i in range(4):
        fcfs.add_request(_req(f"i{i}", 4, "interactive", spec, max_tokens=2))
    fcfs.step()
    fcfs.add_request(_req("long", 40, "batch", spec, max_tokens=4))
    assert _long_tokens(fcfs.scheduler.schedule()) == [40]


def _chunk_cost(base=0.010):
    """A step pays 15 ms more when it carries a prompt chunk."""
    def step_time(num_seqs, num_decode, context, prefill, pairs):
        return base + 0.001 * (num_decode + prefill) + (0.015 if prefill else 0.0)
    return step_time


def test_a_chunk_that_fits_no_step_waits_for_a_decode_to_finish():
    # With 4 decodes a chunk of the smallest size worth a step costs 31+ ms > 18 ms: the
    # batch prompt waits (cap 0), its TTFT (20 s) can afford it.
    spec = SLOSpec.from_dict(SPEC)
    engine = _four_decodes_and_a_long_prompt(spec, _chunk_cost())
    assert _long_tokens(engine.scheduler.schedule()) == []
    assert engine.scheduler.policy.last_prefill_cap == 0
    # An interactive prompt whose TTFT (200 ms) would run out within two plain steps goes
    # now, whatever it costs the decodes.
    engine = _four_decodes_and_a_long_prompt(spec, _chunk_cost(), long="interactive",
                                             arrival=-0.12)
    assert _long_tokens(engine.scheduler.schedule()) == [40]
    # Decodes that miss their TPOT even if no prompt step came (a plain step of 21 ms
    # against 20) have nothing to protect: no cap, the fewest slow steps.
    engine = _four_decodes_and_a_long_prompt(spec, _chunk_cost(base=0.017))
    assert _long_tokens(engine.scheduler.schedule()) == [40]
    assert engine.scheduler.policy.last_prefill_cap is None


def _run_timed(engine, cost):
    """Step `engine` to the end on a clock each step moves by `cost` of its shape; returns
    the sequences it served and the policy's cap at each step."""
    clock, sched = engine.clock, engine.scheduler
    schedule, caps, seqs = sched.schedule, [], {}

    def timed():
        batch = schedule()
        dec = sum(1 for s in batch.seqs if s.num_new_tokens == 1)
        pre = sum(s.num_new_tokens for s in batch.seqs if s.num_new_tokens > 1)
        caps.append(sched.policy.last_prefill_cap if sched.policy else None)
        seqs.update((s.seq.request_id, s.seq) for s in batch.seqs)
        clock.now += cost(len(batch.seqs), dec, 0, pre, 0)
        return batch

    sched.schedule = timed
    seqs.update((s.request_id, s) for s in sched.running)
    outputs = {}
    while engine.has_unfinished:
        _collect(engine.step(), outputs)
    assert set(outputs) == set(seqs)
    return seqs, caps


def _tpot(seq) -> float:
    t = seq.timings
    return (t.last_token_time - t.first_token_time) / (seq.num_output_tokens - 1)


@pytest.mark.parametrize("max_tokens", [3, 6, 10])
def test_decodes_keep_their_tpot_while_a_prompt_waits_or_goes_in_chunks(max_tokens):
    # Stepped on a clock the step-time model moves, from the state above with decodes of
    # 3-10 tokens: the prompt waits, goes in a chunk, or both, and every interactive
    # decode's TPOT is within its 20 ms. FCFS, taking the prompt at once, breaks it.
    spec = SLOSpec.from_dict(SPEC)
    cost = _chunk_cost()
    engine = _four_decodes_and_a_long_prompt(spec, cost, max_tokens=max_tokens)
    seqs, caps = _run_timed(engine, cost)
    assert [seqs[f"i{i}"].num_output_tokens for i in range(4)] == [max_tokens] * 4
    assert all(_tpot(seqs[f"i{i}"]) <= 0.020 for i in range(4))
    assert seqs["long"].num_output_tokens == 4
    fcfs = make_engine(max_num_batched_tokens=64, max_num_seqs=8, num_blocks=128)
    fcfs.clock = Clock()
    for i in range(4):
        fcfs.add_request(_req(f"i{i}", 4, "interactive", spec, max_tokens=max_tokens))
    fcfs.step()
    fcfs.add_request(_req("long", 40, "batch", spec, max_tokens=4))
    seqs, _ = _run_timed(fcfs, cost)
    assert any(_tpot(seqs[f"i{i}"]) > 0.020 for i in range(4))


def test_a_waiting_request_of_a_higher_class_pauses_a_prefill_under_way():
    spec = SLOSpec.from_dict(SPEC)
    clock = Clock()
    engine = _engine(clock, max_num_batched_tokens=16, max_num_seqs=8, num_blocks=128)
    engine.scheduler.policy.ttft_share = math.inf
    engine.add_request(_req("b", 64, "batch", spec))
    engine.step()  # the batch prompt's first 16 tokens
    assert engine.scheduler.running[0].num_computed_tokens == 16
    engine.add_request(_req("i", 8, "interactive", spec, arrival=clock.now))
    batch = engine.scheduler.schedule()
    # the interactive prompt takes the step; the batch prompt keeps its blocks and waits
    assert [(s.seq.request_id, s.num_new_tokens) for s in batch.seqs] == [("i", 8)]


def test_prompt_steps_are_kept_within_a_share_of_the_tightest_ttft():
    spec = SLOSpec.from_dict(SPEC)  # interactive TTFT 200 ms; a third of it: 66.7 ms
    clock = Clock()
    engine = _engine(clock, max_num_batched_tokens=512, max_num_seqs=8, num_blocks=256)
    engine.add_request(_req("b", 400, "batch", spec))
    # No interactive request seen yet: nothing tighter to protect, one 410 ms step.
    assert [s.num_new_tokens for s in engine.scheduler.schedule().seqs] == [400]
    engine = _engine(clock, max_num_batched_tokens=512, max_num_seqs=8, num_blocks=256)
    engine.add_request(_req("i", 4, "interactive", spec, max_tokens=1))
    engine.step()  # an interactive request came and went: one may come again
    engine.add_request(_req("b", 400, "batch", spec))
    # 10 ms + c tokens x 1 ms <= 66.7 ms -> c = 56: a new interactive arrival waits at
    # most one such step.
    assert [s.num_new_tokens for s in engine.scheduler.schedule().seqs] == [56]


def test_a_request_that_cannot_meet_its_ttft_behind_the_queue_is_refused():
    spec = SLOSpec.from_dict(SPEC)  # interactive TTFT 200 ms
    clock = Clock()
    # No decodes running: a step of 32 prompt tokens (the budget) takes 10 + 32 = 42 ms.
    engine = _engine(clock, max_num_batched_tokens=32, max_num_seqs=8, num_blocks=256)
    engine.add_request(_req("b", 200, "batch", spec, max_tokens=4))  # batch: never refused
    # Interactive orders before batch, so the batch prompt is not ahead of these. With k
    # of them queued, the next one's 40 tokens wait for 40 k: ceil(40 (k + 1) / 32) steps.
    for k in range(3):  # 84, 126, 168 ms: within 200
        engine.add_request(_req(f"i{k}", 40, "interactive", spec))
    with pytest.raises(SLOUnattainableError) as e:  # 5 steps: 210 ms
        engine.add_request(_req("i3", 40, "interactive", spec))
    assert e.value.code == "slo_unattainable" and e.value.param == "slo_class"
    assert "predicted 210 ms behind 3 waiting request(s) and 120 prompt tokens" in str(e.value)
    assert engine.scheduler.policy.num_rejected == 1
    assert not any(s.request_id == "i3" for s in engine.scheduler.live_sequences())
    engine.add_request(_req("b2", 40, "batch", spec))  # reject_early false: queued anyway
    # A prompt that misses even alone is not refused for the queue: it is served late.
    engine.add_request(_req("huge", 400, "interactive", spec))
    # FCFS never refuses.
    fcfs = make_engine(max_num_batched_tokens=32, max_num_seqs=8, num_blocks=256)
    for k in range(8):
        fcfs.add_request(_req(f"i{k}", 40, "interactive", spec))


def _drain(engine, clock, outputs: dict, max_steps: int) -> None:
    """Step (10 ms apart, invariants checked) until nothing is left or max_steps ran."""
    for _ in range(max_steps):
        if not engine.has_unfinished:
            return
        clock.now += 0.01
        _collect(engine.step(), outputs)
        engine.check_invariants()


_SLO_SPEC = SLOSpec.from_dict(SPEC)
_request = st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(1, 3),
                     st.sampled_from(["interactive", "batch", None]))
_op = st.one_of(
    st.tuples(st.just("add"), _request),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(_op, max_size=40), num_blocks=st.integers(24, 80),
       budget=st.integers(1, 48), chunked=st.booleans(), per_token=st.sampled_from([0.0, 1e-3]))
def test_engine_bookkeeping_holds_under_the_slo_policy(ops, num_blocks, budget, chunked,
                                                       per_token):
    clock = Clock()
    engine = _engine(clock, _linear(0.005, per_token), num_blocks=num_blocks,
                     max_num_batched_tokens=budget if chunked else 64, chunked=chunked)
    engine.scheduler.policy.min_chunk = 1
    added, outputs = [], {}
    for op, arg in ops:
        clock.now += 0.01
        if op == "add":
            prompt_len, max_tokens, n, cls = arg
            rid = f"r{len(added)}"
            req = EngineRequest(rid, list(range(5, 5 + prompt_len)),
                                SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True),
                                arrival_time=clock.now,
                                slo=_SLO_SPEC.get(cls).request_slo() if cls else None)
            try:
                engine.add_request(req)
            except InvalidParameterError:  # never fits, or refused early: nothing queued
                assert not any(s.request_id == rid for s in engine.scheduler.live_sequences())
                continue
            added.append(rid)
        elif op == "step":
            for _ in range(arg):
                _collect(engine.step(), outputs)
        elif added:
            engine.abort(added[arg % len(added)])
        engine.check_invariants()
    # Everything drains: a step that schedules nothing while work is queued would loop
    # forever, so the drain is bounded (every step here computes at least one token).
    _drain(engine, clock, outputs, 20_000)
    bm = engine.block_manager
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks
    for rid in added:
        assert rid in outputs


def test_prefills_paused_for_a_head_that_cannot_be_admitted_go_on():
    # Three samples of one interactive prompt share a pool with room for two of them. The
    # one not yet admitted orders first (least slack: its whole prompt is ahead of it), so
    # the two under way pause for it; it has no blocks, so they must go on (the younger
    # preempted for the older when the pool runs out), not idle the engine forever.
    clock = Clock()
    engine = _engine(clock, _linear(0.005, 0.0), num_blocks=24, max_num_batched_tokens=41,
                     chunked=True)
    engine.scheduler.policy.min_chunk = 1
    req = EngineRequest("r", list(range(5, 58)), SamplingParams(max_tokens=1, n=3,
                                                                ignore_eos=True),
                        arrival_time=0.0, slo=_SLO_SPEC.get("interactive").request_slo())
    engine.add_request(req)
    outputs = {}
    _drain(engine, clock, outputs, 40)
    assert "r" in outputs and not engine.has_unfinished
    assert engine.scheduler.num_preemptions >= 1  # the pool held two, not three


def test_the_policy_flags_are_checked_by_name():
    from servelm.config import EngineArgs, SchedulerConfig

    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="edf")
    with pytest.raises(ValueError, match="slo_cost_model"):
        EngineArgs(model="m", slo_cost_model="cost.json")  # fcfs: nothing would read it
    args = EngineArgs(model="m", scheduling_policy="slo", slo_cost_model="cost.json")
    assert args.scheduler_config().scheduling_policy == "slo"


def test_best_effort_requests_go_after_every_class_even_a_doomed_one():
    spec = SLOSpec.from_dict(SPEC)
    clock = Clock()
    engine = _engine(clock, max_num_batched_tokens=8, max_num_seqs=1, num_blocks=64)
    engine.add_request(_req("first", 4, "batch", spec, max_tokens=30))
    engine.step()
    clock.now = 0.5
    engine.add_request(EngineRequest("none", list(range(5, 9)), SamplingParams(max_tokens=4),
                                     arrival_time=0.01))
    engine.add_request(_req("doomed", 4, "interactive", spec, arrival=0.02))
    engine.add_request(_req("batch", 4, "batch", spec, arrival=0.4))
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["batch", "doomed", "none"]
