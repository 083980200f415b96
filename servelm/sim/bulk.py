"""Bulk advance: run a replica's plain decodes outside the engine, lazily, when that gives
exactly what stepping gives.

Owns: the decode head (DecodeHead: the sequences at the head of the running list that
decode one token a step and cannot finish yet, advanced without touching them each step,
caught up when they leave it), advance_decodes (steps in which the head is all that runs),
mixed_step (steps whose other work, prefill chunks, finishing decodes and admissions, goes
through the real Scheduler and Engine.step) and finish_run (catch everything up).
Never: schedules, admits, preempts, finishes or prefills itself: that work is the real
Scheduler's and Engine.step's, as is every step of an engine this module does not know
(speculation, a tokenizer, stop tokens, and the SLO policy for mixed steps and for steps
in which it may hold background work).

The head. Between steps it is a prefix of the scheduler's running list, in that order: a
sequence joins when everything before it in the list is in the head and it is a plain
decode (its last sampled token is its one uncomputed token, ignore_eos, no stop tokens,
more than one token left below max_tokens and max_model_len), at most the step's token
budget of them. A member joined at head step j with num_computed_tokens c is, at head step
S, at c + (S - j) computed positions with one more token sampled; its Sequence, the
engine's token counters and the client's record (chunk times, token count) are caught up
only when it leaves: at the step in which it takes its last token (it is then an ordinary
decode of the engine, and finishes in that step), or when the head is dissolved (before a
step that might preempt, or that this module does not cover). Per step the head costs a
few operations plus one visit to each member whose next position takes or fills a block
(members are grouped by that phase): there, through the real BlockManager.allocate, a new
block or a full block into the prefix cache, in the running list's order, as the
scheduler's loop would take them.

A step is then one of:
  - a plain decode step (advance_decodes): the running list is the head, nothing would be
    admitted (nothing waits, or max_num_seqs run), no member takes its last token, and
    the blocks the members need are free; it starts before the next arrival (which
    changes what the router sees; at that instant itself the arrival is admitted first);
  - a mixed step (mixed_step): the head's blocks are taken first, then the real
    Scheduler._schedule_running runs over the rest of the running list (the members
    leaving in this step, then what follows the head), with the head's tokens spent from
    the budget, and _schedule_waiting over the queue; Engine.step runs that batch and the
    SimRunner adds the head's decodes to the step's shape. A member that leaves has its
    block (if its position takes or fills one) taken at its place in the head's order, so
    the scheduler, reaching it, finds nothing left to take: the pool and the prefix cache
    (LRU stamps included) end as in the scheduler's order. Only when the blocks the step
    could need at most are free (so no preemption can happen);
  - otherwise the head is dissolved and the step is Engine.step.
The step's time is the cost model's for its whole shape. tests/sim/test_bulk.py runs
workloads both ways (`simulate(..., bulk=False)`, `servelm sim --no-bulk`) and asserts
identical per-request timings, tokens, steps, clock, engine counters and cache state.

This module reads a few of the engine's private fields (`_pending`, `_step_id`) and calls
the scheduler's two halves: it stands in for Engine.step on the steps it covers, and the
equality tests are what keep the two in step when the engine changes.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from servelm.engine.scheduler import ScheduledBatch
from servelm.engine.step_cost_model import StepShape


# The head's step times are kept while a member may still need them: dropped when the head
# empties, and trimmed to what the oldest member needs once there are _TIMES_TRIM of them.
_TIMES_TRIM = 65536


def _is_plain(engine) -> bool:
    """The engine features this module knows how to skip over."""
    return engine.speculator is None and engine.tokenizer is None and not engine._pending


class DecodeHead:
    """The lazily advanced head of one replica's running list (the module doc)."""

    __slots__ = ("seqs", "info", "groups", "leave", "steps", "t0", "times", "ctx0", "rem0",
                 "sum_join", "shown", "bs", "order", "files", "itl", "marks")

    def __init__(self, bs: int, files: bool = True, itl=None):
        self.seqs: list = []  # the members, in running order
        # seq_id -> [base computed, join step, (order, seq), phase key, remaining at join]
        self.info: dict[int, list] = {}
        self.groups: dict[int, list] = {}  # phase -> [(order, seq)] in running order
        self.leave: list = []  # heap of (step of its last token, order, seq)
        self.steps = 0  # S: head steps run
        self.t0 = 0  # the step times[0] ended
        self.times: list[float] = []  # end time of each head step from t0
        self.ctx0 = 0  # sum of (base + 1 - join): the members' context is ctx0 + k * S
        self.rem0 = 0  # sum of tokens left at join: in flight is rem0 - (k * S - sum_join)
        self.sum_join = 0
        self.shown: list = []  # (order, seq): members leaving in the step about to run
        self.bs = bs
        self.order = itertools.count()
        # Whether a member filling a block has anything to do there: file it in the prefix
        # cache. Without one (and blocks over one position) only taking a block does.
        self.files = files or bs == 1
        # Where the members' chunk gaps go when the records keep no chunk times (an
        # ITLSummary; None: the records get their chunk times). A member caught up over
        # head steps a..b-1 has the gaps between them: gap i is times[i + 1] - times[i],
        # shared by every member whose steps span it; `marks` counts them as a difference
        # array over absolute gap indices (+1 at a, -1 at b - 1), folded into the summary
        # when the times are dropped (fold).
        self.itl = itl
        self.marks: dict[int, int] = {}

    @property
    def context(self) -> int:
        return self.ctx0 + len(self.seqs) * self.steps

    @property
    def in_flight(self) -> int:
        """Tokens the members have still to generate (the router's tokens in flight)."""
        return self.rem0 - (len(self.seqs) * self.steps - self.sum_join)

    def join(self, seq, left: int) -> None:
        c, s = seq.num_computed_tokens, self.steps
        item = (next(self.order), seq)
        key = (c + 1 - s) % self.bs
        rem = seq.max_tokens - (len(seq.token_ids) - seq.num_prompt_tokens)
        self.info[seq.seq_id] = [c, s, item, key, rem]
        self.groups.setdefault(key, []).append(item)
        heapq.heappush(self.leave, (s + left - 1, item[0], seq))
        self.seqs.append(seq)
        self.ctx0 += c + 1 - s
        self.rem0 += rem
        self.sum_join += s

    def catch_up(self, seq, runner, records) -> None:
        """seq's tokens, positions, last token time and record as stepping leaves them."""
        info = self.info[seq.seq_id]
        base, join = info[0], info[1]
        d = self.steps - join
        if d <= 0:
            return
        _catch_up(runner, seq, base + d + 1)
        seq.num_computed_tokens = base + d
        t0, times = self.t0, self.times
        last = seq.timings.last_token_time = times[self.steps - 1 - t0]
        rec = records[seq.request_id]
        if self.itl is None:
            rec.chunk_times += times[join - t0:self.steps - t0]
        else:  # the record keeps its last chunk time only
            chunks = rec.chunk_times
            if chunks:
                self.itl.add_gap(times[join - t0] - chunks[0])
                chunks[0] = last
            else:
                chunks.append(last)
            if d > 1:
                marks = self.marks
                marks[join] = marks.get(join, 0) + 1
                marks[self.steps - 1] = marks.get(self.steps - 1, 0) - 1
        rec.num_output_tokens += d
        # re-based at this step: base + 1 - join and rem - (S - join) are unchanged
        info[0], info[1], info[4] = base + d, self.steps, info[4] - d
        self.sum_join += d
        self.rem0 -= d

    def remove(self, seq) -> None:
        """Take a caught-up member out (its running-list place stays the engine's)."""
        info = self.info.pop(seq.seq_id)
        base, join, item, key, rem = info
        self.groups[key].remove(item)
        self.seqs.remove(seq)
        self.ctx0 -= base + 1 - join
        self.rem0 -= rem
        self.sum_join -= join

    def step_done(self, now: float) -> None:
        self.steps += 1
        self.times.append(now)
        if len(self.times) > _TIMES_TRIM:  # drop times no member can still need
            first = min(info[1] for info in self.info.values())
            if first - self.t0 > _TIMES_TRIM // 2:
                self.fold(first)
                del self.times[:first - self.t0]
                self.t0 = first

    def fold(self, cut: int) -> None:
        """Hand the ITL summary the gaps below absolute index `cut` (times before step cut
        are about to go; no later catch-up starts below it) and keep the count of the
        spans that go on past it."""
        marks = self.marks
        if self.itl is None or not marks:
            return
        t0 = self.t0
        below = [k for k in marks if k < cut]
        if not below:
            return
        n = min(cut - t0, len(self.times) - 1)  # gaps 0..n-1 (relative) have both ends
        deltas = np.zeros(max(n, 1), dtype=np.int64)
        carry = 0
        for k in below:
            v = marks.pop(k)
            if k - t0 < n:
                deltas[k - t0] += v
            else:  # past the last gap with both ends (the spans closing there net 0)
                carry += v
        counts = np.cumsum(deltas)
        carry += int(counts[-1])
        if carry:  # spans still open continue from gap `cut`
            marks[cut] = marks.get(cut, 0) + carry
        if n > 0:
            gaps = np.diff(np.array(self.times[:n + 1], dtype=np.float64))
            self.itl.add_weighted(gaps, counts[:n])


def _left(seq, max_model_len: int) -> int:
    """Tokens seq may still generate if it is a plain decode now, else 0."""
    n = len(seq.token_ids)
    c = seq.num_computed_tokens
    if n - c != 1 or c < seq.num_prompt_tokens:
        return 0
    p = seq.params
    if not p.ignore_eos or p.stop_token_ids:
        return 0
    return min(seq.max_tokens - (n - seq.num_prompt_tokens), max_model_len - n)


def _sync(rep, records) -> DecodeHead:
    """The head as the next step starts: members taking their last token in it leave
    (caught up, into `shown`); the plain decodes right after it join."""
    head = rep.decode_head
    engine = rep.engine
    if head is None:
        bm = engine.block_manager
        head = rep.decode_head = DecodeHead(bm.block_size, bm.prefix_cache is not None,
                                            getattr(rep, "itl", None))
    leave, s = head.leave, head.steps
    while leave and leave[0][0] <= s:
        _, _, seq = heapq.heappop(leave)
        head.catch_up(seq, rep.runner, records)
        head.shown.append(head.info[seq.seq_id][2])  # (order, seq)
        head.remove(seq)
    if not head.seqs and head.times:  # no member needs the times kept so far
        head.fold(head.steps)
        head.t0, head.times = head.steps, []
    running = engine.scheduler.running
    m = len(head.seqs) + len(head.shown)
    budget = engine.scheduler.config.max_num_batched_tokens
    max_model_len = engine.max_model_len
    while m < len(running) and m < budget:
        seq = running[m]
        left = _left(seq, max_model_len)
        if left <= 1:
            break
        head.join(seq, left)
        m += 1
    return head


def finish_run(rep, records: dict) -> None:
    """Dissolve the replica's head: every member caught up to the steps run (Engine.step
    may then run). No-op without one."""
    head = getattr(rep, "decode_head", None)
    if head is None:
        return
    rep.decode_head = None
    runner = rep.runner
    for seq in head.seqs:
        head.catch_up(seq, runner, records)
    head.fold(head.steps)


def _catch_up(runner, seq, num_tokens: int) -> None:
    """Append the sampled tokens seq would hold after stepping: num_tokens in all."""
    n = num_tokens - len(seq.token_ids)
    if n > 0:
        seq.token_ids += runner.tokens(seq, n)


def _touched(head: DecodeHead) -> list:
    """The members whose position this step takes or fills a block, in running order."""
    bs, s = head.bs, head.steps
    groups = head.groups
    fill = groups.get(-s % bs, ()) if head.files else ()
    grow = groups.get((1 - s) % bs, ()) if bs > 1 else ()
    if fill and grow:
        return sorted(fill + grow)
    return fill or grow


def _position(head: DecodeHead, seq) -> int:
    info = head.info[seq.seq_id]
    return info[0] + head.steps - info[1]


def _needs_block(seq, c: int, bs: int) -> bool:
    return c == len(seq.block_table) * bs


def _take_blocks(bm, runner, seq, c: int, bs: int) -> None:
    """What the scheduler's allocate(seq, 1) does for a decode at position c, if its
    position takes or fills a block."""
    if (c + 1) % bs == 0:  # it fills its last block: the cache keys that block's tokens
        # (without a cache, and bs > 1, allocate(seq, 1) does nothing here: _touched leaves
        # such members out, DecodeHead.files)
        seq.num_computed_tokens = c  # as the scheduler sees it at this step
        _catch_up(runner, seq, c + 1)
        bm.allocate_decode(seq)  # allocate(seq, 1): a full block into the cache (+ a new one)
    elif c + 1 > len(seq.block_table) * bs:  # it takes a new block, and fills none
        # Its tokens need no catching up: it holds at least c of them (c is a block's
        # first position: the fill of the block before, or its joining, put them there),
        # and register_computed's bound, min(c + 1, tokens) // bs, is then c // bs either
        # way (bs > 1 here): the blocks that fill registered already.
        seq.num_computed_tokens = c
        bm.allocate_decode(seq)


def advance_decodes(rep, until_s: float, records: dict, defer: bool = False) -> int:
    """Run plain decode steps of replica `rep` that start before `until_s`; returns how many
    (0: the next step is not plain; the caller runs a step). defer: the head stays lazy
    after the call (the caller runs mixed_step or finish_run before anything else reads
    the running sequences); else it is dissolved."""
    engine = rep.engine
    sched = engine.scheduler
    running = sched.running
    if not running or not _is_plain(engine) or (
            sched.policy is not None and sched.policy.rations(running, sched.waiting)):
        # (the SLO policy may hold background rows step by step: those steps are taken one
        # at a time)
        finish_run(rep, records)
        return 0
    head = _sync(rep, records)
    n = 0
    k = len(head.seqs)
    if (not head.shown and k == len(running)
            and not (sched.waiting and k < sched.config.max_num_seqs)):
        n = _run(rep, head, until_s)
    if not defer:
        finish_run(rep, records)
    return n


def _run(rep, head: DecodeHead, until_s: float) -> int:
    """Plain decode steps of the head (the whole running list) that start before until_s
    and before a member's last token: blocks, clock, counters and timeline, step by step."""
    engine, clock, runner = rep.engine, rep.clock, rep.runner
    bm = engine.block_manager
    step_time, bs = _step_time(runner.cost), bm.block_size
    info = head.info
    k = len(head.seqs)
    timeline, stats = rep.timeline, engine.stats
    waiting = len(engine.scheduler.waiting)
    last = head.leave[0][0]  # the first step a member takes its last token in
    steps = 0
    step_s = 0.0
    # The clock and busy time are summed step by step in locals (the same floats); the
    # pool's usage changes only where a member takes a block.
    now, busy = clock.now, runner.busy_s
    used = bm.num_used_blocks / bm.num_blocks
    while head.steps < last and now < until_s:
        touched = _touched(head)
        s = head.steps
        if touched:
            need = 0
            for _, seq in touched:
                i = info[seq.seq_id]
                if _needs_block(seq, i[0] + s - i[1], bs):
                    need += 1
            if need > bm.num_free_blocks:
                break  # the scheduler would preempt: an engine step
            for _, seq in touched:
                i = info[seq.seq_id]
                _take_blocks(bm, runner, seq, i[0] + s - i[1], bs)
            used = bm.num_used_blocks / bm.num_blocks
        step_s = step_time(k, k, head.ctx0 + k * s, 0, 0)
        now += step_s
        busy += step_s
        head.step_done(now)
        steps += 1
        timeline.append((now, used, waiting, k))
    clock.now, runner.busy_s = now, busy
    if steps:
        runner.num_steps += steps
        engine._step_id += steps
        stats.num_steps += steps
        stats.num_generated_tokens += k * steps
        stats.num_computed_tokens += k * steps
        _note_last_step(stats, step_s, k, head.ctx0 + k * (head.steps - 1))
    return steps


def _step_time(cost):
    """The cost model's prediction over a shape's five numbers, without a StepShape built
    per step (every cost model's step_time is its predict; fleet.step_time_of)."""
    own = getattr(cost, "step_time", None)
    return own if own is not None else (lambda *shape: cost.predict(StepShape(*shape)))


def _note_last_step(stats, step_s: float, num_seqs: int, context: int) -> None:
    """The engine's `last_*` counters as Engine._account leaves them after a decode step:
    one token per sequence, context = attention pairs = the sum of sequence lengths."""
    stats.last_step_s = step_s
    stats.last_num_seqs = stats.last_num_tokens = stats.last_num_decode_tokens = num_seqs
    stats.last_num_context_tokens = stats.last_num_attention_pairs = context
    stats.last_num_verify_tokens = stats.last_num_prefill_tokens = 0


def mixed_step(rep, records: dict) -> list | None:
    """One step with the head's decodes lazy and the rest (members taking their last
    token, what follows the head, admissions) through the real Scheduler and Engine.step.
    Returns the step's deltas, or None after dissolving the head when it does not apply
    (the caller runs Engine.step). See the module doc."""
    engine = rep.engine
    sched, bm = engine.scheduler, engine.block_manager
    if not sched.running or not _is_plain(engine) or sched.policy is not None:
        finish_run(rep, records)
        return None
    head = _sync(rep, records)
    k = len(head.seqs)
    shown = head.shown
    if k == 0:  # nothing lazy: an ordinary step (the leaving members are caught up)
        shown.clear()
        return None
    runner, bs = rep.runner, bm.block_size
    running = sched.running
    m = k + len(shown)
    cfg = sched.config
    budget = cfg.max_num_batched_tokens
    info = head.info
    s = head.steps
    # The blocks this step can need at most: the head's, the leaving members', and the
    # rest's for as many tokens as the budget leaves them. Within the free blocks, no
    # preemption can happen, and the order below is the scheduler's.
    touched = _touched(head)
    need = 0
    for _, seq in touched:
        i = info[seq.seq_id]
        if _needs_block(seq, i[0] + s - i[1], bs):
            need += 1
    for _, seq in shown:  # caught up: their fields are current
        if _needs_block(seq, seq.num_computed_tokens, bs):
            need += 1
    left = budget - m
    if left > 0:
        blocks = bm.blocks_for_tokens
        for seq in running[m:]:
            c = seq.num_computed_tokens
            new = min(len(seq.token_ids) - c, left)
            need += max(0, blocks(c + new) - len(seq.block_table))
    if need > bm.num_free_blocks:
        shown.clear()
        finish_run(rep, records)
        return None
    if shown:  # the leaving members take their blocks at their places in the head's order
        # (join order is running order: members join at the head's end)
        for _, seq in sorted([*touched, *shown]):
            c = _position(head, seq) if seq.seq_id in info else seq.num_computed_tokens
            _take_blocks(bm, runner, seq, c, bs)
    else:
        for _, seq in touched:
            i = info[seq.seq_id]
            _take_blocks(bm, runner, seq, i[0] + s - i[1], bs)
    batch = ScheduledBatch()
    sched.encoder_budget.reset()
    sched.running = [seq for _, seq in shown] + running[m:]
    try:
        rest_budget = sched._schedule_running(batch, budget - k)
    finally:
        sched.running = running
    assert not batch.preempted, "a preemption the block bound above excludes"
    sched._schedule_waiting(batch, rest_budget)
    ctx = head.context
    stats = engine.stats
    if batch.is_empty:  # only the head runs: its step alone
        step_s = _step_time(runner.cost)(k, k, ctx, 0, 0)
        rep.clock.now += step_s
        runner.num_steps += 1
        runner.busy_s += step_s
        engine._step_id += 1
        stats.num_steps += 1
        _note_last_step(stats, step_s, k, ctx)
        deltas = []
    else:
        runner.hidden = (k, ctx)
        sched.schedule = lambda: batch  # Engine.step runs the batch built above
        try:
            deltas = engine.step()
        finally:
            del sched.schedule
            runner.hidden = None
        stats.last_num_seqs += k
        stats.last_num_tokens += k
        stats.last_num_decode_tokens += k
        stats.last_num_context_tokens += ctx
        stats.last_num_attention_pairs += ctx  # a one-token step at position c: c + 1 pairs
    stats.num_generated_tokens += k
    stats.num_computed_tokens += k
    head.step_done(rep.clock.now)
    unfinished = any(not seq.is_finished for _, seq in shown)
    shown.clear()
    if unfinished:  # not expected (a leaving member takes its last token): be exact anyway
        finish_run(rep, records)
    return deltas


__all__ = ["DecodeHead", "advance_decodes", "finish_run", "mixed_step"]
