"""The SLO scheduling policy (`--scheduling-policy slo`), beside the scheduler's FCFS.

Owns: the order of the waiting queue (by whether a request can still meet its TTFT, its class
priority, then its deadline slack), the cap on prompt tokens per step that keeps the running
decodes within their TPOT targets (0: none this step), which prompt the step's chunk goes to
when a waiting request orders before the prefills under way, which background work (the
lowest class) sits a step out so that it fills only the higher classes' headroom, and the
early refusal of a request whose TTFT cannot be met behind the current queue
(`SLOUnattainableError`, a 429 over HTTP).
Never: imports torch, allocates blocks, preempts, or decides what a step runs beyond that
order, that cap and those held rows: the Scheduler still admits in order, within its token
budget and blocks, and picks its victims.

Each request carries its targets (`EngineRequest.slo`, a `RequestSLO` resolved from the SLO
spec, servelm/slo.py); one without (best effort) goes after every request that has one.

    deadline  = arrival + ttft_s                         (for a request not yet started)
    slack     = deadline - now - predicted prefill time of its own prompt
    order     = feasible (slack >= 0) before doomed, then priority, then least slack first
                (a preempted request that already streamed tokens resumes first in its class:
                its TTFT is behind it, its TPOT is what waits)

Prefill chunks: a step carrying C prompt tokens next to D decodes takes step_time(D + 1, D,
context, C). Each decode with a TPOT target can take a step of at most

    room = headroom x tpot x (N - 1) - (now - first token) - (N - n - 1) x plain

(n tokens out of N = max_tokens, `plain` the time of a step of the decodes alone,
`tpot_headroom` 0.9): its TPOT is the mean of its gaps, so steps faster than the target
bank time for a slow one. The cap is the largest C whose step fits the smallest room (a
decode whose TPOT is out of reach even if every step left were plain counts for none). When
not even the smallest chunk worth a step (its prompt tokens cost twice the fixed cost a
chunk adds) fits, no prompt runs this step (cap 0) and the decodes go on alone, unless a
prompt cannot wait: one that would lose its TTFT within two plain steps, or a preempted one
resuming. That is the chunk budget `servelm plan prefill --tpot` derives from the roofline,
here from the engine's own step-cost model, per step, for the batch actually running.
Beside it, a step carrying prompt tokens is kept within a third (`ttft_share`) of the
tightest TTFT target among the requests seen: a request of that class arriving during the
step waits for it to end.

Prefills under way pause (their blocks kept) for a waiting request that orders before all
of them (`waiting_first`): a batch prompt half prefilled does not hold an interactive
prompt that arrives behind it for the rest of its chunks. When the scheduler cannot admit
that head in the step (no blocks or seat for it), the paused prefills go on in the step.

Background work: when more than one class is live, the lowest (and best effort beside any
class) is background, and it runs only in what the higher classes leave (`hold`, each step):
on a few cores every extra row slows every token of the step it joins. While a higher-class
prompt waits or prefills (its TTFT pending) no background row runs. Beside higher-class
decodes, background rows and prompt tokens run within an allowance that keeps the step
within `background_share` of the decodes' tightest TPOT target:
  - measured, always (`observe_step`): the allowance is in background tokens (a decode row
    one, a prompt token one) and only a step whose higher-class part was decodes alone
    counts: over the budget it halves to what the step carried, under it with the
    allowance used it grows by one (AIMD: it finds the headroom, and leaves it when the
    interactive load takes it back); without a cost model, while any higher-class
    decode's TPOT so far is over `tpot_headroom` of its target, the allowance is none;
  - with a step-cost model, also the rows whose predicted step fits the smallest room of
    the decodes (`_step_room`, the banked time), and the prompt tokens within the chunk
    cap above; with no decode's TPOT in reach (as for the cap) there is nothing to
    protect and no limit.
With no higher-class work running or waiting, the capacity is idle and background runs
freely. Held rows keep their blocks and seats; a higher-class request that needs a seat or
blocks preempts background rows first (the scheduler's victims). A background row is never
held past its own class's targets: a decode that has waited `tpot_headroom` of its TPOT
since its last token, or a prompt waiting half its TTFT since arrival, runs (so a class
with a real TPOT still meets it, and a batch under sustained load still moves; its window
is paced where its lines are submitted, servelm/server/batch_pacer.py). And a step that
the rationing would leave empty runs without it: holding work while nothing runs would
only idle the engine (and stall a simulated clock forever).

Early refusal, at add time: the prompt tokens ahead of the new request (waiting work and
prefills under way that order before it) plus its own, at the capped chunk per step, give its
predicted TTFT; a request of a `reject_early` class whose prediction exceeds its target, but
that would meet it with nothing ahead, is refused with the prediction in the message.

The step time comes from `step_time(num_seqs, num_decode_tokens, decode_context_tokens,
prefill_tokens, prefill_pairs) -> seconds` (StepCostModel.step_time: the simulator's model,
or a `servelm bench calibrate` file given with --slo-cost-model). Without one the policy
orders the queue and rations background work from measured steps only (no chunk cap, no
refusal): it has nothing to predict with.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from servelm.protocol import EngineRequest, InvalidParameterError

StepTime = Callable[[int, int, int, int, int], float]

class SLOUnattainableError(InvalidParameterError):
    """A request refused at admission: its TTFT cannot be met behind the current queue.
    Over HTTP a 429 (servelm/server/errors.py), the reason in the message."""

    def __init__(self, message: str):
        super().__init__(message, param="slo_class", code="slo_unattainable")


def _pairs(start: int, n: int) -> int:
    """Causal (query, key) pairs of n new tokens after `start` cached ones."""
    return n * start + n * (n + 1) // 2


@dataclass
class Ration:
    """One step's rationing of background work (SLOPolicy.hold), read by the Scheduler."""

    low: float  # sequences of this priority or lower, and best effort, are background
    now: float
    held: set[int] = field(default_factory=set)  # id() of running rows sitting it out
    admit_left: float = 0  # background prompts that may start this step
    # background prompt tokens the step may carry (None: only the chunk cap's limit)
    prompt_tokens: int | None = None

    def is_background(self, seq) -> bool:
        return seq.slo is None or seq.slo.priority >= self.low


class SLOPolicy:
    def __init__(self, clock: Callable[[], float], step_time: StepTime | None = None,
                 min_chunk: int = 16, tpot_headroom: float = 0.9, ttft_share: float = 1 / 3,
                 background_share: float = 0.5):
        self.clock = clock
        self.step_time = step_time
        self.min_chunk = min_chunk
        # Steps are sized to this share of the TPOT target: a request's TPOT is the mean of
        # its steps, and steps sized to the target exactly put half of them just over it
        # (prediction error, the other prefills' per-sequence cost).
        self.tpot_headroom = tpot_headroom
        # Prompt-bearing steps are kept within this share of the tightest TTFT target of
        # the requests seen so far (an arrival waits for the step running when it comes).
        self.ttft_share = ttft_share
        self.tightest_ttft_s = math.inf
        self.num_rejected = 0
        self.last_prefill_cap: int | None = None  # the cap the last step ran with
        # Background work may make a step carrying higher-class decodes at most this share
        # of their tightest TPOT target: their TPOT also pays for the prompt chunks of their
        # class, which the chunk cap sizes from the time the decode steps bank; background
        # rows that took the steps to 0.8 of the target left too little of it (in the
        # simulator, a batch backlog beside traffic at TPOT p50 15 ms cost 6 points of
        # goodput in TTFT misses at 0.8, 1 at 0.5).
        self.background_share = background_share
        self.background_tokens = 0  # the measured allowance (AIMD, observe_step)
        self.num_background_held = 0  # background rows held in the last step
        self._rationed: Ration | None = None  # the last step's, for observe_step

    # -- order -------------------------------------------------------------------------------

    def _key(self, seq, now: float, per_token_s: float) -> tuple:
        slo = seq.slo
        if slo is None:  # best effort: after every request with a class, in arrival order
            return (2, 0, seq.timings.arrival_time)
        if seq.num_output_tokens > 0:  # resumed after preemption: TTFT already met or missed
            return (0, slo.priority, -math.inf)
        slack = (seq.timings.arrival_time + slo.ttft_s - now
                 - seq.num_uncomputed_tokens * per_token_s)
        return (0 if slack >= 0 else 1, slo.priority, slack)

    def order(self, waiting: deque, running: list, budget: int) -> None:
        """Sort the waiting queue in place (the Scheduler admits from its head)."""
        if len(waiting) < 2:
            return
        now = self.clock()
        per_token = self._prefill_s_per_token(running, budget)
        items = sorted(waiting, key=lambda s: self._key(s, now, per_token))
        waiting.clear()
        waiting.extend(items)

    def waiting_first(self, running: list, waiting: deque, budget: int) -> bool:
        """Whether the head of the (ordered) waiting queue goes before every prefill under
        way: then those pause this step (their blocks kept) and the chunk is the head's. A
        batch prompt half prefilled must not hold the prompt of an interactive request
        arriving behind it for the rest of its chunks."""
        if not waiting or self.step_time is None:
            return False
        now = self.clock()
        per_token = self._prefill_s_per_token(running, budget)
        head = self._key(waiting[0], now, per_token)
        found = False
        for seq in running:
            if seq.num_computed_tokens < seq.num_prompt_tokens - 1:
                found = True
                if self._key(seq, now, per_token) <= head:
                    return False
        return found

    # -- chunk size --------------------------------------------------------------------------

    def _decodes(self, running: list, now: float) -> tuple[int, int, float]:
        """(decoding sequences, their context tokens, the longest step all of them can
        take: see `_step_room`)."""
        decoding = [s for s in running if s.num_computed_tokens >= s.num_prompt_tokens]
        num = len(decoding)
        ctx = sum(s.num_tokens for s in decoding)
        room = math.inf
        if not decoding or self.step_time is None:
            return num, ctx, room
        plain = self.step_time(num, num, ctx, 0, 0)  # a step of these decodes alone
        for seq in decoding:
            slo = seq.slo
            if slo is not None:
                room = min(room, self._step_room(seq, slo.tpot_s, now, plain))
        return num, ctx, room

    def _step_room(self, seq, tpot: float, now: float, plain: float) -> float:
        """The longest next step that keeps this decode's TPOT within headroom x its
        target, if every step after it is a plain decode step (`plain` seconds). Its TPOT
        is (last token - first token) / (N - 1) for N = max_tokens tokens: with n tokens
        out, this step and the N - n - 1 after it must fit in headroom * tpot * (N - 1) -
        (now - first token). Steps faster than the target bank the difference for a slow
        one (a prompt chunk); the bank is recomputed every step, so a chunk that spends it
        leaves the next steps less. inf: the request's TPOT is out of reach even if every
        step left were plain (then no step protects it)."""
        target = self.tpot_headroom * tpot
        first = seq.timings.first_token_time
        n = seq.num_output_tokens
        if first is None or n < 1:
            return target
        elapsed = now - first
        total = max(seq.max_tokens, n + 1)
        if elapsed + (total - n) * plain > tpot * (total - 1):
            return math.inf  # missed however the rest goes
        return target * (total - 1) - elapsed - (total - n - 1) * plain

    def prefill_cap(self, running: list, budget: int, waiting=()) -> int | None:
        """Prompt tokens this step may compute (None: no cap; 0: none this step), from what
        the running decodes' TPOT targets leave for this step."""
        if self.step_time is None:
            self.last_prefill_cap = None
            return None
        now = self.clock()
        num, ctx, room = self._decodes(running, now)
        cap = self._largest_chunk(num, ctx, room, budget - num)
        if cap == 0 and self._must_prefill(running, waiting, num, ctx, budget, now):
            cap = None
        if cap != 0 and self.tightest_ttft_s < math.inf:
            # A request of the tightest class arriving now waits for this step to end:
            # keep prompt-bearing steps within a share of its TTFT target.
            limit = self._largest_chunk(num, ctx, self.ttft_share * self.tightest_ttft_s,
                                        budget - num)
            if limit and (cap is None or limit < cap):
                cap = limit
        self.last_prefill_cap = cap
        return cap

    def _largest_chunk(self, num: int, ctx: int, step_room: float, room: int) -> int | None:
        """The largest chunk whose step fits in `step_room` seconds (None: any chunk the
        budget allows; 0: not even the smallest chunk worth a step)."""
        if step_room == math.inf or room <= self.min_chunk:
            return None  # nothing decoding has a target in reach, or the budget is the cap
        f = self.step_time
        if f(num + 1, num, ctx, room, _pairs(0, room)) <= step_room:
            return None
        lo, hi = self.min_chunk, room  # step_time grows with the chunk: bisect
        if f(num + 1, num, ctx, self._worth(num, ctx, room), 0) > step_room:
            # Not even the smallest chunk worth a step of its own fits what the decodes
            # can take: the prompt waits (0) for one of them to finish, unless
            # _must_prefill says it cannot. (Smaller chunks would spend the decodes' time
            # mostly on the fixed cost of a prompt step.)
            return 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if f(num + 1, num, ctx, mid, _pairs(0, mid)) <= step_room:
                lo = mid
            else:
                hi = mid
        return lo

    def _worth(self, num: int, ctx: int, room: int) -> int:
        """The smallest chunk worth a step of its own: one whose prompt tokens cost at
        least twice the fixed cost a prompt chunk adds to a step (a smaller one spends the
        decodes' banked time mostly on that fixed cost)."""
        f = self.step_time
        base = f(num, num, ctx, 0, 0)
        fixed = f(num + 1, num, ctx, 1, 1) - base
        per_token = (f(num + 1, num, ctx, room, 0) - base - fixed) / max(1, room - 1)
        if per_token <= 0:
            return self.min_chunk
        return max(self.min_chunk, min(room, math.ceil(2 * fixed / per_token)))

    def _must_prefill(self, running: list, waiting, num: int, ctx: int, budget: int,
                      now: float) -> bool:
        """Whether a prompt cannot wait a step for the decodes to bank time: a request that
        can still meet its TTFT but would not after two more plain decode steps, or a
        preempted one resuming (its TPOT is what waits)."""
        f = self.step_time
        wait = 2 * f(num, num, ctx, 0, 0)
        full = max(1, budget - num)
        per_token = f(num + 1, num, ctx, full, _pairs(0, full)) / full
        for seq in running:
            if seq.num_computed_tokens < seq.num_prompt_tokens and self._urgent(
                    seq, now, per_token, wait):
                return True
        return any(self._urgent(seq, now, per_token, wait) for seq in waiting)

    @staticmethod
    def _urgent(seq, now: float, per_token: float, wait: float) -> bool:
        slo = seq.slo
        if slo is None:
            return False
        if seq.num_output_tokens > 0:
            return True
        slack = (seq.timings.arrival_time + slo.ttft_s - now
                 - seq.num_uncomputed_tokens * per_token)
        return 0 <= slack < wait

    def _chunk_and_step(self, running: list, budget: int) -> tuple[int, float]:
        """(prompt tokens per step, that step's time) for the batch running now."""
        num, ctx, step_room = self._decodes(running, self.clock())
        room = max(1, budget - num)
        cap = self._largest_chunk(num, ctx, step_room, room) or room
        return cap, self.step_time(num + 1, num, ctx, cap, _pairs(0, cap))

    def _prefill_s_per_token(self, running: list, budget: int) -> float:
        if self.step_time is None:
            return 0.0
        chunk, step_s = self._chunk_and_step(running, budget)
        return step_s / chunk

    # -- background work ---------------------------------------------------------------------

    @staticmethod
    def _background_priority(running: list, waiting) -> float | None:
        """Sequences of this priority or lower (and best effort) are background; None:
        nothing to ration (one class and no best effort, or best effort alone)."""
        prios = {s.slo.priority for s in (*running, *waiting) if s.slo is not None}
        if not prios:
            return None
        if len(prios) > 1:
            return max(prios)
        best_effort = any(s.slo is None for s in (*running, *waiting))
        return math.inf if best_effort else None

    def rations(self, running: list, waiting) -> bool:
        """Whether steps of this state may hold background work (the simulator advances
        plain decodes in bulk only when not)."""
        return self._background_priority(running, waiting) is not None

    def hold(self, running: list, waiting) -> Ration | None:
        """This step's rationing of background work (None: none, everything runs)."""
        self._rationed = None
        self.num_background_held = 0
        low = self._background_priority(running, waiting)
        if low is None:
            return None
        ration = Ration(low, self.clock())
        pending = any(not ration.is_background(s) for s in waiting)
        fore_dec, back = [], []
        for seq in running:
            if ration.is_background(seq):
                back.append(seq)
            elif seq.num_uncomputed_tokens > 1:
                pending = True  # a higher-class prompt prefilling: its TTFT is pending
            else:
                fore_dec.append(seq)
        if not pending and not fore_dec:
            return None  # nothing of a higher class to slow: the idle capacity is theirs
        self._rationed = ration
        rows, tokens = (0, 0) if pending else self._allowance(fore_dec, back, ration.now)
        overdue = False
        for seq in back:
            if self._overdue(seq, ration.now):
                overdue = True
            elif seq.num_uncomputed_tokens > 1:
                if pending or tokens < 1:  # its chunk would take the higher class's time
                    ration.held.add(id(seq))
            elif rows >= 1 and tokens >= 1:
                rows, tokens = rows - 1, tokens - 1
            else:
                ration.held.add(id(seq))
        ration.admit_left = min(rows, 1 if tokens >= 1 else 0)
        # Not pending, every prompt the step may carry is background. An overdue one is
        # not held to a chunk of the allowance.
        ration.prompt_tokens = None if pending or overdue or tokens == math.inf else int(tokens)
        self.num_background_held = len(ration.held)
        return ration

    def unhold(self) -> None:
        """The Scheduler ran the step without its ration (it would have been empty)."""
        self._rationed = None
        self.num_background_held = 0

    def may_admit(self, ration: Ration, seq, chunked: bool) -> bool:
        """Whether waiting background `seq` may start this step (one that waited half its
        class's TTFT always may)."""
        if self._overdue(seq, ration.now):
            return True
        if ration.admit_left < 1:
            return False
        if not chunked and ration.prompt_tokens is not None and (
                seq.num_uncomputed_tokens > ration.prompt_tokens):
            return False  # its whole prompt would go in one step, past the allowance
        ration.admit_left -= 1
        return True

    def _overdue(self, seq, now: float) -> bool:
        """A background sequence held as long as its own class's targets allow: one with
        tokens out (decoding, or recomputing after a preemption) `tpot_headroom` of its
        TPOT since its last token, a prompt half its TTFT since it arrived (best effort has
        no targets: never)."""
        slo = seq.slo
        if slo is None:
            return False
        t = seq.timings
        if seq.num_output_tokens > 0 and t.last_token_time is not None:
            return now - t.last_token_time >= self.tpot_headroom * slo.tpot_s
        return now - t.arrival_time >= slo.ttft_s / 2

    def _allowance(self, fore_dec: list, back: list, now: float) -> tuple[float, float]:
        """(background decode rows, background tokens) a step beside the higher-class
        decodes `fore_dec` may carry: the measured allowance; without a cost model none
        while one of them is behind its TPOT, with one the rows whose step fits their
        rooms (which know how far behind each is; none in reach: no limit)."""
        tokens: float = self.background_tokens
        if self.step_time is None:
            for seq in fore_dec:
                first, n = seq.timings.first_token_time, seq.num_output_tokens
                if first is not None and n >= 2 and (
                        (now - first) / (n - 1) > self.tpot_headroom * seq.slo.tpot_s):
                    return 0, 0  # its TPOT so far is past the headroom: every step is its
            return tokens, tokens
        num, ctx = len(fore_dec), sum(s.num_tokens for s in fore_dec)
        plain = self.step_time(num, num, ctx, 0, 0)
        # a decode whose TPOT is out of reach even if every step left were plain counts
        # for none (as for the chunk cap): with none in reach there is nothing to protect
        rooms = [self._step_room(s, s.slo.tpot_s, now, plain) for s in fore_dec]
        room = min((min(r, self.background_share * s.slo.tpot_s)
                    for r, s in zip(rooms, fore_dec) if r < math.inf), default=math.inf)
        if room == math.inf:
            return math.inf, math.inf
        back_dec = [s for s in back if s.num_uncomputed_tokens <= 1]
        k = 0  # the running rows in order, then one more of the last one's context
        for seq in (*back_dec, *back_dec[-1:]) if back_dec else (None,):
            ctx += seq.num_tokens if seq is not None else 0
            if self.step_time(num + k + 1, num + k + 1, ctx, 0, 0) > room:
                break
            k += 1
        return min(k, tokens), tokens

    def observe_step(self, seqs: list, step_s: float) -> None:
        """A step ran `seqs` (the Scheduler's ScheduledSeqs) in `step_s` seconds: adjust the
        measured background allowance. Only a rationed step whose higher-class part was
        decodes alone says how much background its decodes' TPOT can take."""
        ration = self._rationed
        if ration is None:
            return
        used, tpot = 0, math.inf
        for s in seqs:
            if ration.is_background(s.seq):
                used += s.num_new_tokens
            elif s.start < s.seq.num_prompt_tokens or s.num_new_tokens - s.num_spec > 1:
                return  # a higher-class prompt in the step: its time is not background's
            elif s.seq.slo is not None:
                tpot = min(tpot, s.seq.slo.tpot_s)
        if tpot == math.inf:
            return
        if step_s > self.background_share * tpot:
            self.background_tokens = used // 2
        elif used >= self.background_tokens:
            self.background_tokens = used + 1

    # -- early refusal -----------------------------------------------------------------------

    def check_admission(self, scheduler, request: EngineRequest) -> None:
        """Raise SLOUnattainableError when the request's TTFT cannot be met behind the work
        queued before it (and could be met without it)."""
        slo = request.slo
        if slo is not None and slo.ttft_s < self.tightest_ttft_s:
            self.tightest_ttft_s = slo.ttft_s
        if slo is None or not slo.reject_early or self.step_time is None:
            return
        now = self.clock()
        arrival = request.arrival_time if request.arrival_time is not None else now
        own = len(request.prompt_token_ids) * request.sampling_params.n
        budget = scheduler.config.max_num_batched_tokens
        chunk, step_s = self._chunk_and_step(scheduler.running, budget)
        per_token = step_s / chunk
        mine = (0, slo.priority, arrival + slo.ttft_s - now - own * per_token)
        # prefills under way that order after it pause for it (waiting_first)
        ahead = sum(s.num_uncomputed_tokens for s in scheduler.running
                    if s.num_computed_tokens < s.num_prompt_tokens
                    and self._key(s, now, per_token) <= mine)
        num_ahead = 0
        for seq in scheduler.waiting:
            if self._key(seq, now, per_token) <= mine:
                ahead += seq.num_uncomputed_tokens
                num_ahead += 1
        waited = now - arrival
        alone = waited + math.ceil(own / chunk) * step_s
        predicted = waited + math.ceil((ahead + own) / chunk) * step_s
        if predicted <= slo.ttft_s or alone > slo.ttft_s:
            return
        self.num_rejected += 1
        raise SLOUnattainableError(
            f"slo_class {slo.slo_class!r} cannot meet its TTFT target of "
            f"{slo.ttft_s * 1e3:.0f} ms: predicted {predicted * 1e3:.0f} ms behind "
            f"{num_ahead} waiting request(s) and {ahead} prompt tokens ahead of it "
            f"(alone: {alone * 1e3:.0f} ms); retry later or send a lower class")


def make_scheduling_policy(name: str, clock: Callable[[], float]) -> SLOPolicy | None:
    """The policy object for SchedulerConfig.scheduling_policy (None: FCFS, the scheduler's
    own order)."""
    if name == "fcfs":
        return None
    if name == "slo":
        return SLOPolicy(clock)
    raise ValueError(f"scheduling_policy must be one of ('fcfs', 'slo'), got {name!r}")


__all__ = ["Ration", "SLOPolicy", "SLOUnattainableError", "make_scheduling_policy"]
