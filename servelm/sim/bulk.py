"""Bulk advance: run a replica's plain decode steps in one tight loop instead of one engine
step each, when that gives exactly what stepping gives.

Owns: advance_decodes (and DecodeRun, a run paused between calls, caught up by finish_run),
the test of when a step is a "plain decode" (below) and its update of the engine's state,
the runner's clock and the client's records; and mixed_step, which runs the plain decodes
at the head of the running list outside the engine in a step whose other work (prefill
chunks, finishing decodes, admissions) goes through the real Scheduler and Engine.step.
Never: schedules, admits, preempts, finishes or prefills itself: that work is the real
Scheduler's and Engine.step's, as is every step of an engine this module does not know
(speculation, a tokenizer, stop tokens, the SLO policy for mixed steps).

A plain decode step, starting at virtual time t:
  - no request arrives before t has been admitted elsewhere: t < the next arrival (an
    arrival changes what the router sees, and at t itself it is admitted first);
  - every running sequence computes exactly one token (its last sampled one) and none is
    left out by the token budget; nothing is waiting, or the running list is full
    (max_num_seqs), so the scheduler would not look at the queue;
  - no sequence finishes: each has more than one token left below max_tokens and
    max_model_len (the finishing step goes through the engine);
  - the blocks that this step's sequences need (those whose KV just filled their last
    block) are free: no preemption.
Such a step changes, per sequence, one token, one computed position and at a block boundary
one new block and one prefix-cache registration (made here through the real
BlockManager.allocate, in the scheduler's order); the step's time is the cost model's for
its shape, added to the clock as SimRunner does. Everything else (the runner's view of the
sequence) is caught up by the next Engine.describe, whose deltas are "everything since I
last told you". tests/sim/test_bulk.py runs workloads both ways and asserts identical
per-request timings, tokens, steps, clock, engine counters and cache state.

This module reads a few of the engine's private fields (`_pending`, `_step_id`): it stands
in for Engine.step on the one kind of step it covers, and the equality tests are what keep
the two in step when the engine changes.
"""

from __future__ import annotations

from servelm.sim.cost_model import StepShape


def _is_plain(engine) -> bool:
    """The engine features this loop knows how to skip over."""
    return engine.speculator is None and engine.tokenizer is None and not engine._pending


class DecodeRun:
    """A bulk run of plain decode steps, possibly paused between calls (`defer`): its
    steps' blocks, clock, step counters and timeline are applied as they are run; the
    sequences' tokens and positions and the client's records are caught up by finish_run."""

    __slots__ = ("running", "base", "groups", "limit", "context", "steps", "times", "step_s",
                 "in_flight")

    def __init__(self, running: list, limit: int, context: int, bs: int):
        self.running = list(running)
        self.base = [seq.num_computed_tokens for seq in running]
        # A sequence takes or fills a block only where its next position is 0 or 1 past a
        # block boundary: group the sequences by that phase, in running order (the
        # scheduler's).
        self.groups: dict[int, list[int]] = {}
        for i, c in enumerate(self.base):
            self.groups.setdefault((c + 1) % bs, []).append(i)
        self.limit = limit  # steps before the first finish
        self.context = context  # the next step's context tokens
        self.steps = 0
        self.times: list[float] = []  # each step's end
        self.step_s = 0.0  # the last step's
        # the running sequences' tokens still to generate when the run began (the router's
        # tokens in flight, which Replica.load takes from here while the run is paused)
        self.in_flight = sum(seq.max_tokens - seq.num_output_tokens for seq in running)


def advance_decodes(rep, until_s: float, records: dict, defer: bool = False) -> int:
    """Run plain decode steps of replica `rep` that start before `until_s`; returns how many
    (0: the next step is not plain; the caller runs Engine.step). defer: a run stopped only
    by `until_s` is left pending in `rep.pending_run` and continued by the next call; the
    caller must finish_run before anything else looks at or changes the engine."""
    run = getattr(rep, "pending_run", None)
    if run is None:
        run = _start_run(rep.engine)
        if run is None:
            return 0
        rep.pending_run = run
    before = run.steps
    _run(rep, run, until_s)
    n = run.steps - before
    if not defer or n == 0 or run.steps >= run.limit or rep.clock.now < until_s:
        finish_run(rep, records)
    return n


def _start_run(engine) -> DecodeRun | None:
    """A run, if the engine's next step is a plain decode (the module doc)."""
    sched = engine.scheduler
    running = sched.running
    num_seqs = len(running)
    if not num_seqs or not _is_plain(engine):
        return None
    cfg = sched.config
    if sched.waiting and num_seqs < cfg.max_num_seqs:
        return None
    if num_seqs > cfg.max_num_batched_tokens:
        return None
    max_model_len = engine.max_model_len
    limit = None  # steps before the first finish
    context = 0
    for seq in running:
        n = len(seq.token_ids)
        if n - seq.num_computed_tokens != 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            return None
        p = seq.params
        if not p.ignore_eos or p.stop_token_ids:
            return None
        left = min(seq.max_tokens - (n - seq.num_prompt_tokens), max_model_len - n) - 1
        limit = left if limit is None or left < limit else limit
        context += n
    if limit <= 0:
        return None
    return DecodeRun(running, limit, context, engine.block_manager.block_size)


def finish_run(rep, records: dict) -> None:
    """Catch a pending run's sequences and records up to the steps it ran (nothing read
    them between those steps), and the engine's last-step counters; no-op without one."""
    run = getattr(rep, "pending_run", None)
    if run is None:
        return
    rep.pending_run = None
    steps = run.steps
    if not steps:
        return
    runner = rep.runner
    times = run.times
    now = times[-1]
    for seq, c in zip(run.running, run.base):
        _catch_up(runner, seq, c + 1 + steps)
        seq.num_computed_tokens = c + steps
        seq.timings.last_token_time = now
        rec = records[seq.request_id]
        rec.chunk_times += times
        rec.num_output_tokens += steps
    num_seqs = len(run.running)
    stats = rep.engine.stats
    stats.num_generated_tokens += num_seqs * steps
    stats.num_computed_tokens += num_seqs * steps
    _note_last_step(stats, run.step_s, num_seqs, run.context - num_seqs)


def _catch_up(runner, seq, num_tokens: int) -> None:
    """Append the sampled tokens seq would hold after stepping: num_tokens in all."""
    n = num_tokens - len(seq.token_ids)
    if n > 0:
        seq.token_ids += runner.tokens(seq, n)


def _run(rep, run: DecodeRun, until_s: float) -> None:
    """Run's next steps that start before until_s: blocks taken, the clock, counters and
    timeline, step by step."""
    engine, clock, runner = rep.engine, rep.clock, rep.runner
    bm = engine.block_manager
    cost, bs = runner.cost, bm.block_size
    running, base, groups, times = run.running, run.base, run.groups, run.times
    num_seqs = len(running)
    timeline, stats = rep.timeline, engine.stats
    waiting = len(engine.scheduler.waiting)
    steps, context, limit = run.steps, run.context, run.limit
    while steps < limit and clock.now < until_s:
        fill = groups.get(-steps % bs, ())
        grow = groups.get((1 - steps) % bs, ()) if bs > 1 else ()
        touched = sorted(fill + grow) if fill and grow else (fill or grow)
        # Blocks this step takes: a sequence whose KV filled its last block needs one.
        need = 0
        for i in touched:
            if base[i] + steps == len(running[i].block_table) * bs:
                need += 1
        if need > bm.num_free_blocks:
            run.limit = steps  # the scheduler would preempt: the run ends here
            break
        for i in touched:
            seq = running[i]
            c = base[i] + steps
            if (c + 1) % bs == 0 or c + 1 > len(seq.block_table) * bs:
                seq.num_computed_tokens = c  # as the scheduler sees it at this step
                _catch_up(runner, seq, c + 1)
                bm.allocate(seq, 1)  # a new block and/or a full block into the cache
        step_s = cost.predict(StepShape(num_seqs, num_seqs, context, 0, 0))
        clock.now += step_s
        runner.num_steps += 1
        runner.busy_s += step_s
        times.append(clock.now)
        context += num_seqs
        engine._step_id += 1
        stats.num_steps += 1
        steps += 1
        run.step_s = step_s
        timeline.append((clock.now, bm.num_used_blocks / bm.num_blocks, waiting, num_seqs))
    run.steps, run.context = steps, context


def _note_last_step(stats, step_s: float, num_seqs: int, context: int) -> None:
    """The engine's `last_*` counters as Engine._account leaves them after a decode step:
    one token per sequence, context = attention pairs = the sum of sequence lengths."""
    stats.last_step_s = step_s
    stats.last_num_seqs = stats.last_num_tokens = stats.last_num_decode_tokens = num_seqs
    stats.last_num_context_tokens = stats.last_num_attention_pairs = context
    stats.last_num_verify_tokens = stats.last_num_prefill_tokens = 0


def _leading_decodes(engine, budget: int) -> tuple[int, list, int]:
    """The head of the running list that decodes one token each this step: its length m,
    the hidden decodes among it (no finish, no stop check: run here, below) and the context
    they read. A decode in the head that is not hidden (it may finish) must take no block
    and fill none this step, so that scheduling the hidden ones first leaves the pool and
    the prefix cache exactly as the scheduler's order would; the head ends before the
    first one that would."""
    max_model_len = engine.max_model_len
    bs = engine.block_manager.block_size
    m = ctx = 0
    hidden = []
    for seq in engine.scheduler.running:
        if m == budget:
            break
        n = len(seq.token_ids)
        c = seq.num_computed_tokens
        if n - c != 1 or c < seq.num_prompt_tokens:
            break
        p = seq.params
        if (p.ignore_eos and not p.stop_token_ids
                and min(seq.max_tokens - (n - seq.num_prompt_tokens), max_model_len - n) > 1):
            hidden.append(seq)
            ctx += n
        elif n % bs == 0 or n > len(seq.block_table) * bs:
            break  # it takes or fills a block: it and what follows go through the engine
        m += 1
    return m, hidden, ctx


def mixed_step(rep, records: dict) -> list | None:
    """One engine step in which most sequences at the head of the running list decode one
    token each ("hidden" decodes) and the rest of the step (prefill chunks, finishing
    decodes, admissions) goes through the real Scheduler and Engine.step. Returns the step's
    deltas (the hidden decodes' tokens are stamped here), or None when it does not apply
    (the caller runs Engine.step).

    Scheduler.schedule visits the running list in order, then the waiting queue; here the
    hidden decodes are visited first (their blocks allocated in order, as the scheduler's
    loop would, the same budget spent), then Scheduler._schedule_running runs over the rest
    and Scheduler._schedule_waiting as schedule() runs it. A hidden decode needing a block
    that is not free would preempt: then this does not apply. The step's time is the cost
    model's for the whole step's shape (SimRunner adds the hidden part)."""
    engine = rep.engine
    sched, bm = engine.scheduler, engine.block_manager
    if not _is_plain(engine) or sched.policy is not None or not sched.running:
        return None
    cfg = sched.config
    m, hidden, ctx = _leading_decodes(engine, cfg.max_num_batched_tokens)
    k = len(hidden)
    if k == 0:
        return None
    running = sched.running
    head = running[:m]
    bs = bm.block_size
    growing = sum(1 for seq in hidden if seq.num_computed_tokens == len(seq.block_table) * bs)
    if growing > bm.num_free_blocks:
        return None
    from servelm.engine.scheduler import ScheduledBatch

    batch = ScheduledBatch()
    sched.encoder_budget.reset()
    for seq in hidden:
        c1 = seq.num_computed_tokens + 1
        if c1 % bs == 0 or c1 > len(seq.block_table) * bs:
            bm.allocate(seq, 1)
    if k < m:
        ids = {id(seq) for seq in hidden}
        shown = [seq for seq in head if id(seq) not in ids]
    else:
        shown = []
    sched.running = shown + running[m:]
    try:
        budget = sched._schedule_running(batch, cfg.max_num_batched_tokens - k)
    finally:  # preemption pops from the tail, never into the head
        sched.running = head + sched.running[len(shown):]
    if not batch.preempted:
        sched._schedule_waiting(batch, budget)
    if batch.is_empty:  # only the hidden decodes run: the step is theirs alone
        return _decode_only_step(rep, records, hidden, ctx)
    runner = rep.runner
    runner.hidden = (k, ctx)
    sched.schedule = lambda: batch  # Engine.step runs the batch built above
    try:
        deltas = engine.step()
    finally:
        del sched.schedule
        runner.hidden = None
    _stamp_hidden(rep, records, hidden, rep.clock.now)
    st = engine.stats
    st.last_num_seqs += k
    st.last_num_tokens += k
    st.last_num_decode_tokens += k
    st.last_num_context_tokens += ctx
    st.last_num_attention_pairs += ctx  # a one-token step at position c: c + 1 pairs
    st.num_computed_tokens += k
    return deltas


def _stamp_hidden(rep, records: dict, hidden: list, now: float) -> None:
    """The hidden decodes' part of a step that ended at `now`: what Engine._account and
    _on_token do for a one-token step that finishes nothing, and the client's record."""
    token_of = rep.runner._token
    for seq in hidden:
        seq.num_computed_tokens += 1
        seq.append_token(token_of(seq))
        seq.timings.last_token_time = now
        rec = records[seq.request_id]
        rec.chunk_times.append(now)
        rec.num_output_tokens += 1
    rep.engine.stats.num_generated_tokens += len(hidden)


def _decode_only_step(rep, records: dict, hidden: list, ctx: int) -> list:
    """A step of hidden decodes alone (the rest scheduled nothing), as Engine.step runs it:
    its blocks are taken already; the clock, counters and records as for a bulk step."""
    engine, runner, clock = rep.engine, rep.runner, rep.clock
    k = len(hidden)
    step_s = runner.cost.predict(StepShape(k, k, ctx, 0, 0))
    clock.now += step_s
    runner.num_steps += 1
    runner.busy_s += step_s
    engine._step_id += 1
    stats = engine.stats
    stats.num_steps += 1
    stats.num_computed_tokens += k
    _stamp_hidden(rep, records, hidden, clock.now)
    _note_last_step(stats, step_s, k, ctx)
    return []


__all__ = ["DecodeRun", "advance_decodes", "finish_run", "mixed_step"]
