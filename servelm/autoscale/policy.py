"""The autoscaler's decision: how many replicas a fleet should have, from a load signal.

Owns: `AutoscaleConfig` (the policy file, validated with errors naming the field) and
`Autoscaler.decide(total_signal, num_ready, num_booting, goodput, batch) -> Decision`, the
same object the real controller (servelm/autoscale/controller.py, on Ray) and the simulator
(servelm/sim/autoscale.py, in virtual time) call.
Never: imports torch, reads a clock other than the one it is given, starts or stops a
replica, or looks at a replica: the caller measures the signal and carries out the decision.

The signal is the fleet's total of one per-replica quantity, and the target is that quantity
per replica (servelm's default: tokens in flight, docs/autoscale.md says why):

    wanted   = ceil(total_signal / target)          clamped to [min_replicas, max_replicas]
    capacity = ready + booting                      (booting replicas are capacity to come)
    load     = total_signal / (target * capacity)

    load > scale_up_threshold    for up_window_s      -> up to the smallest `wanted` seen
                                                         over that window (a spike must last)
    load < scale_down_threshold  for down_cooldown_s  -> down to the largest `wanted` seen
                                                         over that window (and no further
                                                         than load (1 + down) / 2, nor by
                                                         more than half), and only if no
                                                         scale event in down_cooldown_s
                                                         (this side reads the signal's mean
                                                         over down_smoothing_s)
    otherwise (the dead band)                         -> hold

Scale to zero (min_replicas 0): a fleet with no work for a whole cool-down goes to zero
replicas ("idle"); at zero, any signal (a request the router holds while it has no replica)
orders replicas at once ("wake"), with no up window: that request is waiting.

With an SLO spec (`slo_spec`, servelm/slo.py), the caller also passes each class's goodput
over the spec's window; a class below its target (over at least `slo_min_requests`
requests) orders one more replica ("slo") when nothing is booting and no scale event came in
the last up_window_s, and holds off any scale-down: the signal's target is a proxy for the
SLO, and this is the SLO itself.

The batch backlog (`BatchDemand`: each batch's lines without a result and the seconds until
its window closes, and the line rate one replica measures with its batch seats) adds the
replicas that finish those lines by their deadlines, earliest deadline first:

    batch_replicas = max over deadlines d (soonest first) of
                     lines due by d / (line_rate x max(d - boot_s, tick_s))

added to the signal as batch_replicas x target, so the rest of the rule is unchanged: a
24-hour batch adds a fraction of a replica, one near its deadline as many as it needs (a
replica ordered now helps only after boot_s). With no rate measured yet, a backlog asks for
one replica (some replica must run it to measure one).

Counting booting replicas as capacity is what keeps a spike from ordering a replica per tick
while the first ones boot: once ready + booting covers `wanted`, `load` drops and nothing
more is ordered.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

SIGNALS = ("tokens_in_flight", "request_rate", "utilization")


class AutoscaleConfigError(ValueError):
    """A policy file or field that cannot be used; the message names the field."""


@dataclass(frozen=True)
class AutoscaleConfig:
    target: float  # the signal per replica the fleet is sized for
    signal: str = "tokens_in_flight"
    min_replicas: int = 1
    max_replicas: int = 4
    scale_up_threshold: float = 1.2  # load (signal / (target x capacity)) above: too few
    scale_down_threshold: float = 0.6  # below: too many; between the two: hold
    up_window_s: float = 30.0  # load above the up threshold this long before scaling up
    down_cooldown_s: float = 300.0  # below the down threshold this long, and no event
    down_smoothing_s: float = 0.0  # the down side reads the signal's mean over this long
    tick_s: float = 5.0  # how often the controller measures and decides
    boot_s: float = 60.0  # how long a replica takes to be ready (the simulator's boot delay)
    drain_timeout_s: float = 120.0  # a removed replica's in-flight requests get this long
    # min_replicas 0 (scale to zero): how long the router holds a request while a replica
    # boots for it, before it answers 503
    hold_timeout_s: float = 300.0
    # The SLO spec (a path, docs/slo.md): a class missing its goodput target scales up
    slo_spec: str | None = None
    slo_min_requests: int = 10  # finished in the window, before a class's goodput counts

    def __post_init__(self):
        if self.signal not in SIGNALS:
            raise AutoscaleConfigError(f"signal: must be one of {list(SIGNALS)}, got "
                                       f"{self.signal!r}")
        for name in ("target", "tick_s", "boot_s", "drain_timeout_s", "hold_timeout_s"):
            _positive(name, getattr(self, name))
        for name in ("up_window_s", "down_cooldown_s", "down_smoothing_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise AutoscaleConfigError(f"{name}: must be a number >= 0, got {value!r}")
        if self.slo_spec is not None:
            from servelm.slo import SLOSpec, SLOSpecError

            try:
                SLOSpec.load(self.slo_spec)
            except SLOSpecError as exc:
                raise AutoscaleConfigError(f"slo_spec: {exc}") from None
        for name in ("min_replicas", "max_replicas", "slo_min_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise AutoscaleConfigError(f"{name}: must be an integer >= 0, got {value!r}")
        if self.max_replicas < max(1, self.min_replicas):
            raise AutoscaleConfigError(f"max_replicas: must be >= min_replicas "
                                       f"({self.min_replicas}) and >= 1, got "
                                       f"{self.max_replicas}")
        _positive("scale_up_threshold", self.scale_up_threshold)
        _positive("scale_down_threshold", self.scale_down_threshold)
        if self.scale_down_threshold >= 1.0 or self.scale_up_threshold <= 1.0:
            raise AutoscaleConfigError(
                "scale_down_threshold, scale_up_threshold: need down < 1 < up (a dead band "
                f"around the target), got {self.scale_down_threshold} and "
                f"{self.scale_up_threshold}")

    @classmethod
    def from_dict(cls, data: dict) -> AutoscaleConfig:
        if not isinstance(data, dict):
            raise AutoscaleConfigError(f"the policy must be a JSON object, got "
                                       f"{type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise AutoscaleConfigError(f"{unknown[0]}: unknown field; known: {sorted(known)}")
        if "target" not in data:
            raise AutoscaleConfigError("target: required (the signal per replica)")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> AutoscaleConfig:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise AutoscaleConfigError(f"--autoscale: cannot read {path}: {exc}") from None
        except ValueError as exc:
            raise AutoscaleConfigError(f"--autoscale: {path} is not JSON: {exc}") from None
        try:
            return cls.from_dict(data)
        except AutoscaleConfigError as exc:
            raise AutoscaleConfigError(f"--autoscale {path}: {exc}") from None


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value < math.inf:
        raise AutoscaleConfigError(f"{name}: must be a positive number, got {value!r}")


class BatchBacklog(NamedTuple):
    """One batch's work left: lines with no result yet, due when its window closes."""

    num_lines: int
    seconds_left: float


class BatchDemand(NamedTuple):
    """The fleet's batch backlog, as the policy reads it beside the signal."""

    backlogs: tuple[BatchBacklog, ...] = ()
    # Lines a second one replica finishes with all its batch seats, measured (the replicas'
    # servelm_batch_line_rate); None before any line finished
    line_rate: float | None = None


class Decision(NamedTuple):
    num_replicas: int  # the fleet's size to be: ready + booting after this decision
    delta: int  # replicas to start (> 0) or to drain (< 0)
    load: float  # (total_signal + batch_replicas x target) / (target x capacity)
    wanted: int  # ceil(total_signal / target + batch_replicas), clamped
    reason: str
    batch_replicas: float = 0.0  # the replicas the batch backlog asked for


def batch_replicas(demand: BatchDemand | None, boot_s: float, tick_s: float) -> float:
    """Replicas that finish every batch's lines by its deadline at the measured per-replica
    line rate, earliest deadline first (the most any prefix of deadlines needs)."""
    if demand is None:
        return 0.0
    backlogs = sorted((b for b in demand.backlogs if b.num_lines > 0),
                      key=lambda b: b.seconds_left)
    if not backlogs:
        return 0.0
    rate = demand.line_rate
    if rate is None or not 0 < rate < math.inf:
        return 1.0
    need = num_due = 0.0
    for b in backlogs:
        num_due += b.num_lines
        need = max(need, num_due / (rate * max(b.seconds_left - boot_s, tick_s)))
    return need


class Autoscaler:
    """Decides at each call (the caller calls every `config.tick_s`); keeps the recent
    history of `wanted` and when the last scale event was."""

    def __init__(self, config: AutoscaleConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._wanted: deque[tuple[float, int, int]] = deque()  # (time, wanted, smoothed)
        self._totals: deque[tuple[float, float]] = deque()  # (time, total_signal)
        self._above_since: float | None = None
        self._below_since: float | None = None
        self._last_event: float | None = None
        self.num_scale_ups = 0
        self.num_scale_downs = 0
        self.slo = None
        if config.slo_spec is not None:
            from servelm.slo import SLOSpec

            self.slo = SLOSpec.load(config.slo_spec)

    def slo_missed(self, goodput: dict | None) -> str | None:
        """The first class below its goodput target, from {class: (goodput, requests)} over
        the spec's window (None: every class meets it, or too few requests to tell)."""
        if self.slo is None or not goodput:
            return None
        for c in self.slo.classes:
            value, count = goodput.get(c.name, (None, 0))
            if value is not None and count >= self.config.slo_min_requests \
                    and value < c.target:
                return c.name
        return None

    def wanted(self, total_signal: float) -> int:
        c = self.config
        n = math.ceil(max(0.0, total_signal) / c.target - 1e-9)
        return min(c.max_replicas, max(c.min_replicas, n))

    def decide(self, total_signal: float, num_ready: int, num_booting: int = 0,
               goodput: dict | None = None, batch: BatchDemand | None = None) -> Decision:
        """goodput: {SLO class: (goodput over the spec's window or None, requests counted)},
        read with an SLO spec only; batch: the batch backlog (None: no batches)."""
        c = self.config
        extra = batch_replicas(batch, c.boot_s, c.tick_s)
        decision = self._decide(total_signal + extra * c.target, num_ready, num_booting,
                                goodput)
        return decision._replace(batch_replicas=extra) if extra else decision

    def _decide(self, total_signal: float, num_ready: int, num_booting: int,
                goodput: dict | None) -> Decision:
        c = self.config
        now = self.clock()
        capacity = num_ready + num_booting
        wanted = self.wanted(total_signal)
        load = total_signal / (c.target * max(1, capacity))
        smoothed = self._smoothed(now, total_signal)
        self._wanted.append((now, wanted, self.wanted(smoothed)))
        horizon = max(c.up_window_s, c.down_cooldown_s)
        while self._wanted and self._wanted[0][0] < now - horizon:
            self._wanted.popleft()
        smoothed_load = smoothed / (c.target * max(1, capacity))
        if capacity == 0:  # scaled to zero: a request held at the router wakes one now
            if total_signal > 0:
                return self._event(now, max(1, wanted), 0, load, wanted, "wake")
            return Decision(0, 0, 0.0, wanted, "hold")
        if capacity < c.min_replicas or capacity > c.max_replicas:  # out of bounds: fix now
            target = min(c.max_replicas, max(c.min_replicas, capacity))
            return self._event(now, target, capacity, load, wanted, "bounds")
        self._above_since = (self._above_since if self._above_since is not None else now) \
            if load > c.scale_up_threshold else None
        self._below_since = (self._below_since if self._below_since is not None else now) \
            if smoothed_load < c.scale_down_threshold else None
        if self._above_since is not None and now - self._above_since >= c.up_window_s:
            target = min(w for t, w, _ in self._wanted if t >= now - c.up_window_s)
            if target > capacity:
                return self._event(now, target, capacity, load, wanted, "up")
        missed = self.slo_missed(goodput)
        if missed is not None:
            if num_booting == 0 and capacity < c.max_replicas and (
                    self._last_event is None or now - self._last_event >= c.up_window_s):
                return self._event(now, capacity + 1, capacity, load, wanted, f"slo:{missed}")
            return Decision(capacity, 0, load, wanted, "hold")  # never down while missing
        if self._below_since is not None and now - self._below_since >= c.down_cooldown_s \
                and (self._last_event is None or now - self._last_event >= c.down_cooldown_s):
            target = max(w for t, _, w in self._wanted if t >= now - c.down_cooldown_s)
            # Land mid dead band, not on the target, and remove at most half: the signal
            # per replica grows faster than 1 / replicas (fewer replicas, bigger batches,
            # slower steps), so a cut sized to reach the target would land above it.
            landing = (1 + c.scale_down_threshold) / 2
            if target == 0 and smoothed == 0:  # min_replicas 0 and no work all cool-down
                return self._event(now, 0, capacity, load, wanted, "idle")
            target = max(target, self.wanted(smoothed / landing), math.ceil(capacity / 2))
            if target < capacity:
                return self._event(now, target, capacity, load, wanted, "down")
        return Decision(capacity, 0, load, wanted, "hold")

    def _smoothed(self, now: float, total_signal: float) -> float:
        """The signal's mean over the last down_smoothing_s (the scale-down side reads it:
        an instantaneous count of work in flight is noisy, and one high sample should not
        restart a cool-down)."""
        self._totals.append((now, total_signal))
        while self._totals and self._totals[0][0] <= now - self.config.down_smoothing_s:
            self._totals.popleft()
        if not self._totals:
            return total_signal
        return sum(v for _, v in self._totals) / len(self._totals)

    def _event(self, now: float, target: int, capacity: int, load: float, wanted: int,
               reason: str) -> Decision:
        if target == capacity:
            return Decision(capacity, 0, load, wanted, "hold")
        self._last_event = now
        self._above_since = self._below_since = None  # the new fleet is judged afresh
        if target > capacity:
            self.num_scale_ups += 1
        else:
            self.num_scale_downs += 1
        return Decision(target, target - capacity, load, wanted, reason)


__all__ = ["SIGNALS", "AutoscaleConfig", "AutoscaleConfigError", "Autoscaler", "BatchBacklog",
           "BatchDemand", "Decision", "batch_replicas"]
