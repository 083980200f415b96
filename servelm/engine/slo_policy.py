"""The SLO scheduling policy (`--scheduling-policy slo`), beside the scheduler's FCFS.

Owns: the order of the waiting queue (by whether a request can still meet its TTFT, its class
priority, then its deadline slack), the cap on prompt tokens per step that keeps the running
decodes within their TPOT targets, and the early refusal of a request whose TTFT cannot be met
behind the current queue (`SLOUnattainableError`, a 429 over HTTP).
Never: imports torch, allocates blocks, preempts, or decides what a step runs beyond that
order and that cap: the Scheduler still admits in order, within its token budget and blocks.

Each request carries its targets (`EngineRequest.slo`, a `RequestSLO` resolved from the SLO
spec, servelm/slo.py); one without (best effort) goes after every request that has one.

    deadline  = arrival + ttft_s                         (for a request not yet started)
    slack     = deadline - now - predicted prefill time of its own prompt
    order     = feasible (slack >= 0) before doomed, then priority, then least slack first
                (a preempted request that already streamed tokens resumes first in its class:
                its TTFT is behind it, its TPOT is what waits)

Prefill chunks: a step carrying C prompt tokens next to D decodes takes step_time(D + 1, D,
context, C); the cap is the largest C (at least `min_chunk`, so prompts always move) that
keeps that step within the tightest TPOT target among the running decodes (times
`tpot_headroom`, 0.9: a TPOT is the mean of a request's steps), and there is none when
even `min_chunk` tokens put the step over it (no chunk size keeps that step within the
target; small ones only make more slow steps): the chunk budget
`servelm plan prefill --tpot` derives from the roofline, here from the engine's own step-cost
model, per step, for the batch actually running.

Early refusal, at add time: the prompt tokens ahead of the new request (waiting work that
orders before it, prefills under way) plus its own, at the capped chunk per step, give its
predicted TTFT; a request of a `reject_early` class whose prediction exceeds its target, but
that would meet it with nothing ahead, is refused with the prediction in the message.

The step time comes from `step_time(num_seqs, num_decode_tokens, decode_context_tokens,
prefill_tokens, prefill_pairs) -> seconds` (StepCostModel.step_time: the simulator's model,
or a `servelm bench calibrate` file given with --slo-cost-model). Without one the policy only
orders the queue (no chunk cap, no refusal): it has nothing to predict with.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

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


class SLOPolicy:
    def __init__(self, clock: Callable[[], float], step_time: StepTime | None = None,
                 min_chunk: int = 16, tpot_headroom: float = 0.9):
        self.clock = clock
        self.step_time = step_time
        self.min_chunk = min_chunk
        # Steps are sized to this share of the TPOT target: a request's TPOT is the mean of
        # its steps, and steps sized to the target exactly put half of them just over it
        # (prediction error, the other prefills' per-sequence cost).
        self.tpot_headroom = tpot_headroom
        self.num_rejected = 0
        self.last_prefill_cap: int | None = None  # the cap the last step ran with

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

    # -- chunk size --------------------------------------------------------------------------

    def _decodes(self, running: list) -> tuple[int, int, float]:
        """(decoding sequences, their context tokens, the tightest TPOT among them)."""
        num = ctx = 0
        tightest = math.inf
        for seq in running:
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                num += 1
                ctx += seq.num_tokens
                if seq.slo is not None and seq.slo.tpot_s < tightest:
                    tightest = seq.slo.tpot_s
        return num, ctx, tightest

    def prefill_cap(self, running: list, budget: int) -> int | None:
        """Prompt tokens this step may compute (None: no cap), from the tightest TPOT among
        the running decodes."""
        if self.step_time is None:
            self.last_prefill_cap = None
            return None
        num, ctx, tpot = self._decodes(running)
        cap = self._largest_chunk(num, ctx, tpot, budget - num)
        self.last_prefill_cap = cap
        return cap

    def _largest_chunk(self, num: int, ctx: int, tpot: float, room: int) -> int | None:
        if tpot == math.inf or room <= self.min_chunk:
            return None  # nothing decoding has a target, or the budget is the cap
        tpot *= self.tpot_headroom
        f = self.step_time
        if f(num + 1, num, ctx, room, _pairs(0, room)) <= tpot:
            return None
        lo, hi = self.min_chunk, room  # step_time grows with the chunk: bisect
        if f(num + 1, num, ctx, lo, _pairs(0, lo)) > tpot:
            # Even the smallest chunk puts the step over the target (a step with a prompt
            # chunk has a fixed cost of its own: on a slow CPU over the whole budget): no
            # chunk keeps it, and a small one only multiplies the slow steps (a 900-token
            # prompt in 16-token chunks is 57 of them). No cap: the fewest slow steps.
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if f(num + 1, num, ctx, mid, _pairs(0, mid)) <= tpot:
                lo = mid
            else:
                hi = mid
        return lo

    def _chunk_and_step(self, running: list, budget: int) -> tuple[int, float]:
        """(prompt tokens per step, that step's time) for the batch running now."""
        num, ctx, tpot = self._decodes(running)
        room = max(1, budget - num)
        cap = self._largest_chunk(num, ctx, tpot, room) or room
        return cap, self.step_time(num + 1, num, ctx, cap, _pairs(0, cap))

    def _prefill_s_per_token(self, running: list, budget: int) -> float:
        if self.step_time is None:
            return 0.0
        chunk, step_s = self._chunk_and_step(running, budget)
        return step_s / chunk

    # -- early refusal -----------------------------------------------------------------------

    def check_admission(self, scheduler, request: EngineRequest) -> None:
        """Raise SLOUnattainableError when the request's TTFT cannot be met behind the work
        queued before it (and could be met without it)."""
        slo = request.slo
        if slo is None or not slo.reject_early or self.step_time is None:
            return
        now = self.clock()
        arrival = request.arrival_time if request.arrival_time is not None else now
        own = len(request.prompt_token_ids) * request.sampling_params.n
        budget = scheduler.config.max_num_batched_tokens
        chunk, step_s = self._chunk_and_step(scheduler.running, budget)
        per_token = step_s / chunk
        mine = (0, slo.priority, arrival + slo.ttft_s - now - own * per_token)
        ahead = sum(s.num_uncomputed_tokens for s in scheduler.running
                    if s.num_computed_tokens < s.num_prompt_tokens)
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


__all__ = ["SLOPolicy", "SLOUnattainableError", "make_scheduling_policy"]
