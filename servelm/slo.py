"""The SLO spec: request classes with TTFT and TPOT targets, read by every part of servelm.

Owns: `SLOClass` and `SLOSpec` (one JSON file, or the `--slo-ttft-ms` / `--slo-tpot-ms` flags
as a one-class spec), resolving what a request asks for (`priority` / `slo_class`) to its
class, whether a finished request met its class's targets, `SlidingGoodput` (per-class goodput
over a sliding window, the server's gauge) and `goodput_by_class` (the same judgement over a
finished run's records, for `servelm bench` and `servelm sim`).
Never: imports torch, schedules anything (servelm/engine/slo_policy.py orders the queue from
the targets a request carries), or reads a clock it is not given.

The file (docs/slo.md):

    {"classes": [
        {"name": "interactive", "priority": 0, "ttft_ms": 500, "tpot_ms": 50, "percentile": 90},
        {"name": "batch", "priority": 1, "ttft_ms": 20000, "tpot_ms": 200, "percentile": 50,
         "reject_early": false}],
     "default_class": "interactive",
     "window_s": 60}

A lower `priority` is served first (vLLM's convention for its `priority` field). A class is
met over a window when at least `percentile` % of its finished requests met both targets:
goodput (the share meeting both) >= percentile / 100.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

from servelm.protocol import InvalidParameterError, RequestSLO


class SLOSpecError(ValueError):
    """A spec file or field that cannot be used; the message names the field."""


def _number(where: str, value, *, low: float = 0.0, high: float = math.inf,
            low_open: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
        and (low < value if low_open else low <= value) and value <= high
    if not ok or not math.isfinite(value):
        bound = f"in ({low:g}, {high:g}]" if high < math.inf else f"> {low:g}"
        raise SLOSpecError(f"{where}: must be a number {bound}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SLOClass:
    name: str
    ttft_ms: float
    tpot_ms: float
    priority: int = 0  # lower is served first
    percentile: float = 90.0  # the class is met when this % of its requests meet both targets
    # Refuse (429) a request that cannot meet its TTFT behind the current queue under the
    # SLO scheduling policy; False: queue it anyway (a batch class that wants every answer).
    reject_early: bool = True

    def __post_init__(self):
        where = f"class {self.name!r}"
        if not isinstance(self.name, str) or not self.name.strip():
            raise SLOSpecError(f"classes[].name: must be a non-empty string, got {self.name!r}")
        _number(f"{where}: ttft_ms", self.ttft_ms)
        _number(f"{where}: tpot_ms", self.tpot_ms)
        _number(f"{where}: percentile", self.percentile, high=100.0)
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise SLOSpecError(f"{where}: priority: must be an integer, got {self.priority!r}")
        if not isinstance(self.reject_early, bool):
            raise SLOSpecError(f"{where}: reject_early: must be true or false, got "
                               f"{self.reject_early!r}")

    @property
    def ttft_s(self) -> float:
        return self.ttft_ms / 1e3

    @property
    def tpot_s(self) -> float:
        return self.tpot_ms / 1e3

    @property
    def target(self) -> float:
        """The goodput this class needs (0-1)."""
        return self.percentile / 100.0

    def request_slo(self) -> RequestSLO:
        """What a request of this class carries to the engine."""
        return RequestSLO(self.name, self.priority, self.ttft_s, self.tpot_s, self.reject_early)

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Both targets met (a request with one output token has no TPOT to miss)."""
        return ttft_s is not None and ttft_s <= self.ttft_s \
            and (tpot_s is None or tpot_s <= self.tpot_s)


@dataclass(frozen=True)
class SLOSpec:
    classes: tuple[SLOClass, ...]
    default_class: str
    window_s: float = 60.0  # the server's sliding goodput window

    def __post_init__(self):
        if not self.classes:
            raise SLOSpecError("classes: need at least one class")
        names = [c.name for c in self.classes]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise SLOSpecError(f"classes: the name {dup!r} is used twice")
        prios = [c.priority for c in self.classes]
        dup = next((p for p in prios if prios.count(p) > 1), None)
        if dup is not None:
            # `priority: N` on a request names one class: two classes cannot share it.
            raise SLOSpecError(f"classes: priority {dup} is used by two classes")
        if self.default_class not in names:
            raise SLOSpecError(f"default_class: {self.default_class!r} is not a class; "
                               f"classes: {names}")
        _number("window_s", self.window_s)

    # -- building ----------------------------------------------------------------------------

    @classmethod
    def single(cls, ttft_ms: float, tpot_ms: float, percentile: float = 90.0,
               window_s: float = 60.0) -> SLOSpec:
        """The one-class spec the `--slo-ttft-ms` / `--slo-tpot-ms` flags describe."""
        return cls((SLOClass("default", ttft_ms, tpot_ms, 0, percentile),), "default",
                   window_s)

    @classmethod
    def from_dict(cls, data) -> SLOSpec:
        if not isinstance(data, dict):
            raise SLOSpecError(f"the spec must be a JSON object, got {type(data).__name__}")
        _known("", data, {"classes", "default_class", "window_s"})
        raw = data.get("classes")
        if not isinstance(raw, list):
            raise SLOSpecError("classes: required, a list of class objects")
        known = {f.name for f in fields(SLOClass)}
        classes = []
        for i, item in enumerate(raw):
            if not isinstance(item, dict):
                raise SLOSpecError(f"classes[{i}]: must be an object, got {item!r}")
            _known(f"classes[{i}].", item, known)
            for req in ("name", "ttft_ms", "tpot_ms"):
                if req not in item:
                    raise SLOSpecError(f"classes[{i}].{req}: required")
            classes.append(SLOClass(**item))
        default = data.get("default_class", classes[0].name if classes else None)
        return cls(tuple(classes), default, data.get("window_s", 60.0))

    @classmethod
    def load(cls, path: str | Path) -> SLOSpec:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise SLOSpecError(f"--slo-spec: cannot read {path}: {exc}") from None
        except ValueError as exc:
            raise SLOSpecError(f"--slo-spec: {path} is not JSON: {exc}") from None
        try:
            return cls.from_dict(data)
        except SLOSpecError as exc:
            raise SLOSpecError(f"--slo-spec {path}: {exc}") from None

    def to_dict(self) -> dict:
        return {"classes": [{f.name: getattr(c, f.name) for f in fields(SLOClass)}
                            for c in self.classes],
                "default_class": self.default_class, "window_s": self.window_s}

    # -- requests ----------------------------------------------------------------------------

    def get(self, name: str) -> SLOClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.classes]

    def resolve(self, priority: int | None = None, slo_class: str | None = None) -> SLOClass:
        """The class a request asks for: by `slo_class` name, by `priority` (the class with
        that priority), or the default. Raises InvalidParameterError naming the field."""
        by_name = by_prio = None
        if slo_class is not None:
            by_name = next((c for c in self.classes if c.name == slo_class), None)
            if by_name is None:
                raise InvalidParameterError(
                    f"slo_class {slo_class!r} is not one of this server's classes "
                    f"{self.names}", param="slo_class")
        if priority is not None:
            by_prio = next((c for c in self.classes if c.priority == priority), None)
            if by_prio is None:
                raise InvalidParameterError(
                    f"priority {priority!r} is not one of this server's class priorities "
                    f"{ {c.name: c.priority for c in self.classes} }", param="priority")
        if by_name is not None and by_prio is not None and by_name is not by_prio:
            raise InvalidParameterError(
                f"priority {priority} is class {by_prio.name!r}, not slo_class "
                f"{slo_class!r}: send one of the two", param="priority")
        return by_name or by_prio or self.get(self.default_class)


def _known(prefix: str, data: dict, known: set[str]) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise SLOSpecError(f"{prefix}{unknown[0]}: unknown field; known: {sorted(known)}")


def spec_from_flags(path: str | None, ttft_ms: float | None, tpot_ms: float | None,
                    percentile: float = 90.0) -> SLOSpec | None:
    """The spec a command was given: `--slo-spec FILE` (it replaces the TTFT/TPOT flags: the
    file is the one description), else the one class those flags describe (a target not
    given is unbounded), None when there is neither."""
    if path is not None:
        return SLOSpec.load(path)
    if ttft_ms is None and tpot_ms is None:
        return None
    unbounded = 1e12  # a spec's numbers must be finite
    return SLOSpec.single(ttft_ms if ttft_ms is not None else unbounded,
                          tpot_ms if tpot_ms is not None else unbounded, percentile)


class SlidingGoodput:
    """Per-class goodput over the last `window_s` seconds of finishes (the server's gauge:
    a lifetime ratio stops moving after an hour of traffic, a window shows the last minute).

    record(class, met, now) once per finished request; goodput(class, now) the share met
    among those finished in (now - window_s, now], None when there were none."""

    def __init__(self, spec: SLOSpec):
        self.spec = spec
        self._events: dict[str, deque[tuple[float, bool]]] = {c.name: deque()
                                                               for c in spec.classes}
        self._met = dict.fromkeys(self._events, 0)

    def record(self, slo_class: str, met: bool, now: float) -> None:
        self._events[slo_class].append((now, met))
        self._met[slo_class] += met
        self._expire(slo_class, now)

    def _expire(self, slo_class: str, now: float) -> None:
        q = self._events[slo_class]
        horizon = now - self.spec.window_s
        while q and q[0][0] <= horizon:
            _, met = q.popleft()
            self._met[slo_class] -= met

    def count(self, slo_class: str, now: float) -> int:
        self._expire(slo_class, now)
        return len(self._events[slo_class])

    def num_met(self, slo_class: str, now: float) -> int:
        """Of those counted, how many met both targets: fleets add these and the counts
        (goodput is a ratio: replicas' ratios do not average)."""
        self._expire(slo_class, now)
        return self._met[slo_class]

    def goodput(self, slo_class: str, now: float) -> float | None:
        self._expire(slo_class, now)
        n = len(self._events[slo_class])
        return self._met[slo_class] / n if n else None


def goodput_by_class(spec: SLOSpec, records: Iterable, classes: Iterable[str]) -> dict:
    """Per class over a finished run: requests, how many met both targets, goodput (failures
    and early rejections count against it), rejections, and whether the class met its
    percentile. `records`: bench RequestRecords; `classes`: each record's class name."""
    out = {c.name: {"num_requests": 0, "num_met": 0, "num_rejected": 0} for c in spec.classes}
    for rec, name in zip(records, classes):
        row = out[name]
        row["num_requests"] += 1
        if rec.error == "slo_unattainable" or (rec.error == "http_429" and "slo_unattainable"
                                               in (rec.error_detail or "")):
            row["num_rejected"] += 1  # the simulator's record, or a client's 429
        if rec.is_ok and spec.get(name).met(rec.ttft_s, rec.tpot_s):
            row["num_met"] += 1
    for name, row in out.items():
        n = row["num_requests"]
        row["goodput"] = row["num_met"] / n if n else None
        row["target"] = spec.get(name).target
        row["meets_target"] = None if not n else row["goodput"] >= row["target"]
    return out




def parse_class_mix(text: str, spec: SLOSpec, flag: str = "--class-mix") -> list[tuple[str, float]]:
    """'interactive=0.7,batch=0.3' -> [(name, share)], shares normalised to 1; every name a
    class of the spec. Errors name the flag."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, share = part.partition("=")
        if not sep:
            raise ValueError(f"{flag}: expected NAME=SHARE, got {part!r}")
        if name not in spec.names:
            raise ValueError(f"{flag}: {name!r} is not a class of the SLO spec {spec.names}")
        try:
            value = float(share)
        except ValueError:
            raise ValueError(f"{flag}: {name}'s share must be a number, got {share!r}") from None
        if not 0 < value < math.inf:
            raise ValueError(f"{flag}: {name}'s share must be positive, got {share!r}")
        out.append((name, value))
    if not out:
        raise ValueError(f"{flag}: no class given")
    total = sum(s for _, s in out)
    return [(n, s / total) for n, s in out]


def assign_classes(num: int, mix: list[tuple[str, float]], seed: int = 0) -> list[str]:
    """A class per request, drawn with the mix's shares (seeded: the simulator and `bench
    serve` given the same flags send the same classes in the same order)."""
    import random

    rng = random.Random(f"slo-classes-{seed}")
    names = [n for n, _ in mix]
    weights = [s for _, s in mix]
    return rng.choices(names, weights, k=num)


def parse_class_lengths(items, spec: SLOSpec, flag: str = "--class-len") -> dict[str, tuple[str, str]]:
    """['batch=1000:2000/256', ...] -> {class: (input_len, output_len)} (range strings as
    --input-len / --output-len take them)."""
    out = {}
    for item in items or ():
        name, sep, lens = item.partition("=")
        inp, slash, outp = lens.partition("/")
        if not sep or not slash or not inp or not outp:
            raise ValueError(f"{flag}: expected NAME=INPUT_LEN/OUTPUT_LEN, got {item!r}")
        if name not in spec.names:
            raise ValueError(f"{flag}: {name!r} is not a class of the SLO spec {spec.names}")
        out[name] = (inp, outp)
    return out


__all__ = ["SLOClass", "SLOSpec", "SLOSpecError", "SlidingGoodput", "assign_classes",
           "goodput_by_class", "parse_class_lengths", "parse_class_mix", "spec_from_flags"]
