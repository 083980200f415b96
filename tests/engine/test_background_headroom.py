"""Background work under the SLO policy (servelm/engine/slo_policy.py: hold, observe_step):
batch-class rows run only in the headroom the interactive class leaves, on a fake clock that
each step moves by a cost of its composition (no wall clock anywhere). Each rule is set
against the same workload under the policy without its rationing (`_Unrationed`: the queue
order and chunk cap alone, as before it), where the interactive class does worse."""

from __future__ import annotations

import math
from types import SimpleNamespace

from fake_runner import make_engine
from test_engine_properties import _collect
from test_slo_policy import SPEC, Clock, _req
from servelm.engine.kv_connector import NoKVConnector
from servelm.engine.slo_policy import SLOPolicy
from servelm.engine.step_cost_model import step_shape
from servelm.protocol import EngineRequest, SamplingParams
from servelm.slo import SLOSpec

_SPEC = SLOSpec.from_dict(SPEC)  # interactive TPOT 20 ms, TTFT 200 ms; batch TPOT 500 ms


def _cost(seqs, dec, ctx, pre, pairs):
    """8 ms a step, 2 ms per decode row, 0.5 ms per prompt token."""
    return 0.008 + 0.002 * dec + 0.0005 * pre


class _Unrationed(SLOPolicy):
    """The policy without its rationing of background work."""

    def hold(self, running, waiting):
        return None


def _engine(model=True, num_blocks=256, policy=SLOPolicy, max_num_seqs=16,
            background_share=0.8, **kw):
    """Steps here cost 8 ms + 2 ms a decode row; the background budget 0.8 x 20 ms."""
    clock = Clock()
    engine = make_engine(max_num_batched_tokens=64, max_num_seqs=max_num_seqs,
                         num_blocks=num_blocks)
    engine.clock = clock
    engine.scheduler.policy = policy(clock, _cost if model else None,
                                     background_share=background_share, **kw)
    execute = engine.runner.execute

    def run_step(step):  # the step takes its cost on the clock, as a real one would
        clock.now += _cost(*step_shape(step))
        return execute(step)

    engine.runner.execute = run_step
    return engine


def _run(engine, steps: list | None = None, max_steps: int = 5000) -> dict:
    """Step to the end; `steps` gets (interactive decode rows, batch decode rows, batch
    prompt tokens) of each step. Returns request id -> Sequence."""
    sched, seqs = engine.scheduler, {}
    schedule = sched.schedule

    def recorded():
        batch = schedule()
        seqs.update((s.seq.request_id, s.seq) for s in batch.seqs)
        if steps is not None and batch.seqs:
            dec = [s for s in batch.seqs if s.start >= s.seq.num_prompt_tokens]
            steps.append((sum(1 for s in dec if s.seq.slo.priority == 0),
                          sum(1 for s in dec if s.seq.slo.priority == 1),
                          sum(s.num_new_tokens for s in batch.seqs
                              if s.seq.slo.priority == 1 and s not in dec)))
        return batch

    sched.schedule = recorded
    outputs: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished:
            break
        _collect(engine.step(), outputs)
        engine.check_invariants()
        # one place each: a sequence admitted while still queued (or twice) would be run
        # twice, and once finished left in the running list with nothing to compute
        live = sched.live_sequences()
        assert len({id(s) for s in live}) == len(live)
    assert not engine.has_unfinished
    sched.schedule = schedule
    return seqs


def _tpot(seq) -> float:
    t = seq.timings
    return (t.last_token_time - t.first_token_time) / (seq.num_output_tokens - 1)


def _add(engine, n_inter: int, n_batch: int, max_tokens: int = 12) -> None:
    for i in range(n_inter):
        engine.add_request(_req(f"i{i}", 8, "interactive", _SPEC, max_tokens=max_tokens))
    for i in range(n_batch):
        engine.add_request(_req(f"b{i}", 8, "batch", _SPEC, max_tokens=max_tokens))


def test_without_headroom_a_batch_backlog_leaves_interactive_steps_alone():
    # Four interactive decodes take 16 ms a step, the whole 0.8 x 20 ms budget: with the
    # cost model no batch row joins them, each interactive TPOT is what it is without the
    # batch, and the batch runs once they are done. Unrationed, the batch rows ride along
    # from the start and every interactive TPOT misses its 20 ms.
    alone = _engine()
    _add(alone, 4, 0)
    base = _run(alone)
    engine = _engine()
    _add(engine, 4, 6)
    steps: list = []
    seqs = _run(engine, steps)
    assert all(back == prompt == 0 for fore, back, prompt in steps if fore)
    assert [_tpot(seqs[f"i{i}"]) for i in range(4)] == [_tpot(base[f"i{i}"]) for i in range(4)]
    assert all(seqs[f"b{i}"].num_output_tokens == 12 for i in range(6))
    assert any(back for fore, back, _ in steps if not fore)  # the idle capacity is the batch's
    free = _engine(policy=_Unrationed)
    _add(free, 4, 6)
    seqs = _run(free)
    assert all(_tpot(seqs[f"i{i}"]) > 0.020 for i in range(4))


def test_with_headroom_batch_rows_fill_it_and_interactive_keeps_its_target():
    # Two interactive decodes take 12 ms: two batch rows fit the 16 ms budget beside them,
    # never a third.
    engine = _engine()
    _add(engine, 2, 6, max_tokens=40)
    steps: list = []
    seqs = _run(engine, steps)
    beside = [back for fore, back, _ in steps if fore]
    assert max(beside) == 2
    assert all(_tpot(seqs[f"i{i}"]) <= 0.020 for i in range(2))
    assert all(seqs[f"b{i}"].num_output_tokens == 40 for i in range(6))


def test_measured_steps_alone_keep_the_batch_to_the_headroom():
    # No cost model (a server without --slo-cost-model): the allowance learns from the
    # steps' measured times, and the interactive TPOT stays within its target, where
    # unrationed every batch row rides along and it does not.
    engine = _engine(model=False)
    _add(engine, 4, 6, max_tokens=40)
    steps: list = []
    seqs = _run(engine, steps)
    assert all(_tpot(seqs[f"i{i}"]) <= 0.020 for i in range(4))
    assert all(seqs[f"b{i}"].num_output_tokens == 40 for i in range(6))
    free = _engine(model=False, policy=_Unrationed)
    _add(free, 4, 6, max_tokens=40)
    seqs = _run(free)
    assert all(_tpot(seqs[f"i{i}"]) > 0.020 for i in range(4))


def _step_seqs(*rows):
    """ScheduledSeq-like rows for observe_step: (priority, tokens run, a prompt chunk)."""
    out = []
    for prio, n, prompt in rows:
        slo = _SPEC.get("interactive" if prio == 0 else "batch").request_slo()
        seq = SimpleNamespace(slo=slo, num_prompt_tokens=8)
        out.append(SimpleNamespace(seq=seq, start=0 if prompt else 20, num_new_tokens=n,
                                   num_spec=0))
    return out


def test_the_measured_allowance_grows_into_headroom_and_halves_past_it():
    # AIMD over background tokens, judged only on rationed steps whose interactive part
    # is decodes alone: +1 a step under 0.8 x 20 ms with the allowance used, halved to
    # what the step carried over it, untouched by a step with an interactive prompt or
    # one that did not use what it had.
    clock = Clock()
    policy = SLOPolicy(clock, background_share=0.8)
    live = [SimpleNamespace(slo=_SPEC.get(c).request_slo(), num_uncomputed_tokens=1,
                            num_output_tokens=1, num_tokens=9,
                            timings=SimpleNamespace(first_token_time=None, arrival_time=0.0,
                                                    last_token_time=0.0))
            for c in ("interactive", "batch")]
    assert policy.hold(live, []) is not None and policy.background_tokens == 0
    fore = (0, 1, False)
    for want in (1, 2, 3):
        policy.observe_step(_step_seqs(fore, *[(1, 1, False)] * (want - 1)), 0.010)
        assert policy.background_tokens == want
    policy.observe_step(_step_seqs(fore, (1, 1, False)), 0.010)  # 1 of 3 used
    assert policy.background_tokens == 3
    policy.observe_step(_step_seqs(fore, (1, 1, False), (1, 2, True)), 0.010)
    assert policy.background_tokens == 4  # a background prompt's tokens count
    policy.observe_step(_step_seqs(fore, (0, 8, True), *[(1, 1, False)] * 4), 0.030)
    assert policy.background_tokens == 4  # an interactive prompt's step says nothing
    policy.observe_step(_step_seqs(fore, *[(1, 1, False)] * 4), 0.017)
    assert policy.background_tokens == 2
    policy.observe_step(_step_seqs(fore), 0.017)  # over with none: none
    assert policy.background_tokens == 0
    assert policy.hold(live[:1], []) is None  # one class: nothing rationed
    policy.observe_step(_step_seqs(fore), 0.001)
    assert policy.background_tokens == 0


def test_a_batch_row_held_without_headroom_still_gets_its_own_class_tpot():
    # Interactive traffic that never leaves headroom: the batch row is held, yet gets a
    # step once it has waited 0.9 x its class's 500 ms TPOT, and so finishes, at its own
    # target; it is never preempted for it.
    engine = _engine(num_blocks=1024)
    engine.scheduler.policy.ttft_share = math.inf
    engine.add_request(_req("b0", 8, "batch", _SPEC, max_tokens=6))
    engine.step()  # its prompt and first token, before the interactive load
    b0 = engine.scheduler.running[0]
    start, n = engine.clock.now, 0
    while not b0.is_finished:
        live = sum(1 for s in engine.scheduler.live_sequences() if s.slo.priority == 0)
        for _ in range(4 - live):  # sustained: four interactive requests at all times
            engine.add_request(_req(f"i{n}", 8, "interactive", _SPEC, max_tokens=400,
                                    arrival=engine.clock.now))
            n += 1
        engine.step()
        assert engine.clock.now - start < 60.0, "the batch row never ran"
    assert b0.timings.num_preemptions == 0
    tpot = _tpot(b0)
    assert 0.9 * 0.5 <= tpot <= 0.5  # held, as long as its own target allows


def test_an_interactive_prompt_takes_seats_from_batch_rows():
    # Every seat holds a batch row: the interactive prompt preempts one (it is recomputed
    # later) rather than waiting for a batch line to finish, as it does unrationed.
    ttft = {}
    for policy in (SLOPolicy, _Unrationed):
        engine = _engine(max_num_seqs=4, policy=policy)
        for i in range(4):
            engine.add_request(_req(f"b{i}", 16, "batch", _SPEC, max_tokens=60))
        for _ in range(4):
            engine.step()
        engine.add_request(_req("i0", 16, "interactive", _SPEC, max_tokens=4,
                                arrival=engine.clock.now))
        seqs = _run(engine)
        i0 = seqs["i0"].timings
        ttft[policy] = i0.first_token_time - i0.arrival_time
        assert i0.num_preemptions == 0
        assert all(seqs[f"b{i}"].num_output_tokens == 60 for i in range(4))
        if policy is SLOPolicy:
            assert sum(seqs[f"b{i}"].timings.num_preemptions for i in range(4)) == 1
    assert ttft[SLOPolicy] <= 0.2 < ttft[_Unrationed]


class _SlowLoad(NoKVConnector):
    """The interactive request's prefix is being fetched from outside the pool until
    `until` on the engine's clock (a tier read): it waits, skipped, until then."""

    def __init__(self, clock, until: float):
        self.clock, self.until = clock, until

    def plan_load(self, seq, match):
        if seq.request_id == "i0" and self.clock() < self.until:
            return SimpleNamespace(num_blocks=0, is_pending=True)
        return None


def test_a_step_the_ration_would_leave_empty_runs_the_held_work():
    # The interactive request waits for its KV (nothing of its class can run) while its
    # pending prompt holds the batch row. Holding that too would leave the step empty:
    # on a virtual clock, a loop that never advances, so the load never lands. The held
    # row runs instead, and the interactive request goes once its KV is there.
    clock = Clock()
    engine = make_engine(max_num_batched_tokens=64, num_blocks=256,
                         kv_connector=_SlowLoad(clock, until=0.2))
    engine.clock = clock
    engine.scheduler.policy = SLOPolicy(clock, _cost, background_share=0.8)
    execute = engine.runner.execute

    def run_step(step):
        clock.now += _cost(*step_shape(step))
        return execute(step)

    engine.runner.execute = run_step
    engine.add_request(_req("b0", 8, "batch", _SPEC, max_tokens=60))
    engine.step()
    engine.add_request(_req("i0", 8, "interactive", _SPEC, max_tokens=2, arrival=clock.now))
    b0 = engine.scheduler.running[0]
    ration = engine.scheduler.policy.hold(engine.scheduler.running, engine.scheduler.waiting)
    assert ration is not None and id(b0) in ration.held  # i0's prompt is pending
    seqs = _run(engine, max_steps=500)
    i0 = seqs["i0"].timings
    assert clock.now > 0.2 and i0.first_token_time > 0.2  # it waited for its load
    assert b0.num_output_tokens == 60
