"""Background work under the SLO policy (servelm/engine/slo_policy.py: hold, observe_step):
batch-class rows run only in the headroom the interactive class leaves, on a fake clock that
each step moves by a cost of its composition (no wall clock anywhere)."""

from __future__ import annotations

from fake_runner import make_engine
from test_engine_properties import _collect
from test_slo_policy import SPEC, Clock, _req
from servelm.engine.slo_policy import SLOPolicy
from servelm.slo import SLOSpec

_SPEC = SLOSpec.from_dict(SPEC)  # interactive TPOT 20 ms; batch priority 1, TTFT 20 s


def _cost(seqs, dec, ctx, pre, pairs):
    """8 ms a step, 2 ms per decode row, 0.5 ms per prompt token."""
    return 0.008 + 0.002 * dec + 0.0005 * pre


def _engine(model=True, num_blocks=256, **kw):
    clock = Clock()
    engine = make_engine(max_num_batched_tokens=64, max_num_seqs=16, num_blocks=num_blocks)
    engine.clock = clock
    engine.scheduler.policy = SLOPolicy(clock, _cost if model else None, **kw)
    return engine


def _run(engine, steps: list | None = None, max_steps: int = 2000) -> dict:
    """Step to the end, the clock moved by _cost of each step's composition; `steps` gets
    (interactive decode rows, batch rows) per step. Returns request id -> Sequence."""
    sched, clock, seqs = engine.scheduler, engine.clock, {}
    schedule = sched.schedule

    def timed():
        batch = schedule()
        dec = sum(1 for s in batch.seqs if s.num_new_tokens == 1)
        pre = sum(s.num_new_tokens for s in batch.seqs if s.num_new_tokens > 1)
        seqs.update((s.seq.request_id, s.seq) for s in batch.seqs)
        if steps is not None and batch.seqs:
            fore = sum(1 for s in batch.seqs if s.seq.slo.priority == 0
                       and s.start >= s.seq.num_prompt_tokens)
            back = sum(1 for s in batch.seqs if s.seq.slo.priority == 1)
            steps.append((fore, back))
        pending.append(_cost(len(batch.seqs), dec, 0, pre, 0))
        return batch

    pending: list = []
    execute = engine.runner.execute

    def run_step(step):  # the step takes its cost on the clock, as a real one would
        clock.now += pending.pop()
        return execute(step)

    sched.schedule = timed
    engine.runner.execute = run_step
    outputs: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished:
            break
        _collect(engine.step(), outputs)
        engine.check_invariants()
    assert not engine.has_unfinished
    return seqs


def _tpot(seq) -> float:
    t = seq.timings
    return (t.last_token_time - t.first_token_time) / (seq.num_output_tokens - 1)


def _add(engine, n_inter: int, n_batch: int, max_tokens: int = 12) -> None:
    for i in range(n_inter):
        engine.add_request(_req(f"i{i}", 8, "interactive", _SPEC, max_tokens=max_tokens))
    for i in range(n_batch):
        engine.add_request(_req(f"b{i}", 8, "batch", _SPEC, max_tokens=max_tokens))


def test_without_headroom_queued_batch_work_leaves_interactive_steps_alone():
    # Four interactive decodes take 16 ms a step, the whole 0.8 x 20 ms budget: with the
    # cost model no batch row joins them, each interactive TPOT is what it is without the
    # batch, and the batch runs once the interactive requests are done.
    alone = _engine()
    _add(alone, 4, 0)
    base = _run(alone)
    engine = _engine()
    _add(engine, 4, 6)
    steps: list = []
    seqs = _run(engine, steps)
    assert all(back == 0 for fore, back in steps if fore)
    assert [_tpot(seqs[f"i{i}"]) for i in range(4)] == [_tpot(base[f"i{i}"]) for i in range(4)]
    assert all(seqs[f"b{i}"].num_output_tokens == 12 for i in range(6))
    assert any(back for fore, back in steps if not fore)


def test_with_headroom_batch_rows_fill_it_and_interactive_keeps_its_target():
    # Two interactive decodes take 12 ms: two batch rows fit the 16 ms budget beside them.
    engine = _engine()
    _add(engine, 2, 6)
    steps: list = []
    seqs = _run(engine, steps)
    beside = [back for fore, back in steps if fore]
    assert max(beside) == 2
    assert all(_tpot(seqs[f"i{i}"]) <= 0.020 for i in range(2))
    assert all(seqs[f"b{i}"].num_output_tokens == 12 for i in range(6))


def test_measured_steps_alone_shrink_the_batch_rows_to_the_headroom():
    # No cost model: the allowance learns from the steps' measured times. After the first
    # slow steps the batch rows beside the four interactive decodes go to none; the
    # interactive TPOT ends within its target, where with the policy's background budget
    # switched off (share inf) every batch row rides along and it does not.
    engine = _engine(model=False)
    _add(engine, 4, 6, max_tokens=40)
    steps: list = []
    seqs = _run(engine, steps)
    beside = [back for fore, back in steps if fore]
    assert beside[-10:] == [0] * 10 and sum(1 for b in beside if b) <= 4
    assert all(_tpot(seqs[f"i{i}"]) <= 0.020 for i in range(4))
    free = _engine(model=False, background_share=float("inf"))
    _add(free, 4, 6, max_tokens=40)
    steps = []
    seqs = _run(free, steps)
    assert all(_tpot(seqs[f"i{i}"]) > 0.020 for i in range(4))


def test_a_batch_row_held_past_its_class_ttft_runs_anyway():
    # Interactive traffic that never leaves headroom: the batch row is held, yet gets a
    # step once it has waited its class's TTFT (20 s), and so finishes.
    engine = _engine(ttft_share=float("inf"), num_blocks=1024)  # none preempted for blocks
    engine.add_request(_req("b0", 8, "batch", _SPEC, max_tokens=3))
    _run_steps(engine, 1)  # its prompt and first token, before the interactive load
    b0 = engine.scheduler.running[0]
    assert b0.num_output_tokens == 1
    held_since, n = engine.clock.now, 0
    while engine.clock.now - held_since < 45.0 and not b0.is_finished:
        live = sum(1 for s in engine.scheduler.live_sequences() if s.slo.priority == 0)
        for _ in range(4 - live):  # sustained: four interactive requests at all times
            engine.add_request(_req(f"i{n}", 8, "interactive", _SPEC, max_tokens=400))
            n += 1
        _run_steps(engine, 1)
    assert b0.is_finished and b0.timings.num_preemptions == 0
    assert b0.timings.finish_time - held_since > 2 * _SPEC.get("batch").ttft_s


def test_a_held_batch_row_gives_its_blocks_to_an_interactive_prompt():
    # The pool is full of held batch rows: the interactive prompt preempts them (they are
    # recomputed later) rather than waiting for blocks that a held row never gives back.
    engine = _engine(num_blocks=24)
    for i in range(4):
        engine.add_request(_req(f"b{i}", 16, "batch", _SPEC, max_tokens=60))
    _run_steps(engine, 4)
    engine.add_request(_req("i0", 60, "interactive", _SPEC, max_tokens=4))
    seqs = _run(engine)
    assert seqs["i0"].timings.num_preemptions == 0
    assert any(seqs[f"b{i}"].timings.num_preemptions for i in range(4))
    assert all(seqs[f"b{i}"].num_output_tokens == 60 for i in range(4))


def _run_steps(engine, n: int) -> None:
    execute = engine.runner.execute

    def run_step(step):
        rows = len(step.seqs)
        engine.clock.now += _cost(rows, rows, 0, 0, 0)
        return execute(step)

    engine.runner.execute = run_step
    try:
        for _ in range(n):
            engine.step()
    finally:
        engine.runner.execute = execute
