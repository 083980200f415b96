"""Bulk advance: run a replica's plain decode steps in one tight loop instead of one engine
step each, when that gives exactly what stepping gives.

Owns: advance_decodes, the test of when a step is a "plain decode" (below) and its update of
the engine's state, the runner's clock and the client's records.
Never: schedules, admits, preempts, finishes or prefills: the first step that would do any
of those is left to Engine.step, as is every step of an engine this loop does not know
(speculation, a tokenizer, stop tokens).

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


def advance_decodes(rep, until_s: float, records: dict) -> int:
    """Run plain decode steps of replica `rep` that start before `until_s`; returns how many
    (0: the next step is not plain; the caller runs Engine.step)."""
    engine = rep.engine
    sched, bm = engine.scheduler, engine.block_manager
    running = sched.running
    num_seqs = len(running)
    if not num_seqs or not _is_plain(engine):
        return 0
    cfg = sched.config
    if sched.waiting and num_seqs < cfg.max_num_seqs:
        return 0
    if num_seqs > cfg.max_num_batched_tokens:
        return 0
    max_model_len = engine.max_model_len
    limit = None  # steps before the first finish
    context = 0
    for seq in running:
        n = len(seq.token_ids)
        if n - seq.num_computed_tokens != 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            return 0
        p = seq.params
        if not p.ignore_eos or p.stop_token_ids:
            return 0
        left = min(seq.max_tokens - (n - seq.num_prompt_tokens), max_model_len - n) - 1
        limit = left if limit is None or left < limit else limit
        context += n
    if limit <= 0:
        return 0
    runner = rep.runner
    base = [seq.num_computed_tokens for seq in running]
    steps, step_s, times = _run(rep, running, base, context, limit, until_s)
    if not steps:
        return 0
    # The sequences and records as `steps` one-token steps leave them, caught up at once:
    # nothing reads them between those steps (their blocks were taken step by step).
    now = times[-1]
    for seq, c in zip(running, base):
        _catch_up(runner, seq, c + 1 + steps)
        seq.num_computed_tokens = c + steps
        seq.timings.last_token_time = now
        rec = records[seq.request_id]
        rec.chunk_times += times
        rec.num_output_tokens += steps
    stats = engine.stats
    stats.num_generated_tokens += num_seqs * steps
    stats.num_computed_tokens += num_seqs * steps
    _note_last_step(stats, step_s, num_seqs, context + num_seqs * (steps - 1))
    return steps


def _catch_up(runner, seq, num_tokens: int) -> None:
    """Append the sampled tokens seq would hold after stepping: num_tokens in all."""
    n = num_tokens - len(seq.token_ids)
    if n > 0:
        seq.token_ids += runner.tokens(seq, n)


def _run(rep, running: list, base: list[int], context: int, limit: int, until_s: float):
    """The steps of a plain decode run from computed tokens `base`: blocks taken, the clock,
    counters and timeline, step by step; the sequences' tokens and records are the caller's
    to catch up. Returns (steps, the last step's seconds, every step's end)."""
    engine, clock, runner = rep.engine, rep.clock, rep.runner
    bm = engine.block_manager
    cost, bs = runner.cost, bm.block_size
    num_seqs = len(running)
    # A sequence takes or fills a block only where its next position is 0 or 1 past a block
    # boundary: group the sequences by that phase, in running order (the scheduler's).
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(base):
        groups.setdefault((c + 1) % bs, []).append(i)
    timeline, stats = rep.timeline, engine.stats
    waiting = len(engine.scheduler.waiting)
    times: list[float] = []
    steps = 0
    step_s = 0.0
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
        timeline.append((clock.now, bm.num_used_blocks / bm.num_blocks, waiting, num_seqs))
    return steps, step_s, times


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


__all__ = ["advance_decodes", "mixed_step"]
