"""The benchmark records docs/choosing.md is made of, and the crossovers computed from them.

Owns: the record kinds benchmarks/choosing.py reads (each a pattern on the path under
benchmarks/results/), the CPU class a record was measured on (derived from the CPU facts the
record stores: its `machine` or `cpu_model`, and its instruction-set flags where it recorded
them), the newest record of each kind on each class, and where one measured series overtakes
another. Never: runs a benchmark, reads a CPU class from a file name, or compares figures
measured on two CPU classes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from itertools import combinations
from pathlib import Path
from typing import Any, NamedTuple

STAMP = r"(?P<stamp>\d{8}T\d{6}Z)"

# Files of one kind with one stamp are one record: a serve run writes one file per engine and
# load, and they are read together. `variant` splits a kind whose files measure different
# settings (one quantization method a file).
KINDS: dict[str, re.Pattern[str]] = {name: re.compile(pattern) for name, pattern in {
    "best-vs-best": rf"best-vs-best-{STAMP}/summary\.json",
    "offline-single": rf"offline-single-{STAMP}\.json",
    "offline-batch64": rf"offline-batch64-{STAMP}\.json",
    "gguf-same-file": rf"(?:quant-single-gguf-vs-llama\.cpp|offline-single-gguf)-{STAMP}\.json",
    "quant-single": rf"quant-single-(?P<variant>[a-z0-9-]+?)-{STAMP}\.json",
    "quant-batch64": rf"quant-batch64-(?P<variant>[a-z0-9-]+?)-{STAMP}\.json",
    "shared-prefix": rf"offline-shared-prefix-{STAMP}\.json",
    "serve-documents": rf"serve-documents-(?:sequential|batch)-[a-z.]+-{STAMP}\.json",
    "serve-sweep": rf"serve-sweep-[a-z.]+-{STAMP}\.json",
    "spec": rf"spec-{STAMP}\.json",
    "lora": rf"lora-{STAMP}\.json",
    "kv-tiers": rf"kv-tiers-multiturn-{STAMP}/result\.json",
    "long-context": rf"long-context-{STAMP}/result\.json",
    "mixed-crossover": rf"mixed-crossover-{STAMP}/result\.json",
}.items()}


class Record(NamedTuple):
    kind: str
    variant: str
    stamp: str
    cpu_class: str
    paths: tuple[str, ...]  # under benchmarks/results/, as a figure cites them
    data: tuple[Any, ...]  # each path's parsed JSON

    @property
    def name(self) -> str:
        """The name a figure cites: the file, or the files' common pattern for a run of
        several (`serve-documents-*-20261130T043601Z.json`)."""
        if len(self.paths) == 1:
            return self.paths[0]
        first, last = self.paths[0], self.paths[-1]
        head = next((i for i, (a, b) in enumerate(zip(first, last)) if a != b), len(first))
        tail = next((i for i, (a, b) in enumerate(zip(first[::-1], last[::-1])) if a != b),
                    len(first))
        return first[:head] + "*" + first[len(first) - tail:]

    def rows(self) -> list[dict[str, Any]]:
        """Every result of the record's files, in path order (a file holds one or a list)."""
        out: list[dict[str, Any]] = []
        for item in self.data:
            out.extend(item if isinstance(item, list) else [item])
        return out


def cpu_facts(data: Any) -> tuple[str, list[str] | None]:
    """(the CPU's name, its recorded instruction-set flags or None) as a record stores them."""
    first = data[0] if isinstance(data, list) and data else data
    if not isinstance(first, dict):
        return "", None
    machine = first.get("machine") or {}
    return str(machine.get("cpu") or first.get("cpu_model") or ""), machine.get("cpu_flags")


def cpu_class(cpu: str, flags: Iterable[str] | None) -> str:
    """The class of CPU whose figures may be compared with each other.

    The instruction set decides which kernels run (bf16 dot products, AMX tiles), so two
    records are comparable only where it is the same. A record that stored no flags gets a
    class of its own: its ISA cannot be told from the name alone.
    """
    upper = cpu.upper()
    if "AMD" in upper:
        vendor = "AMD EPYC" if "EPYC" in upper else "AMD"
    elif "INTEL" in upper:
        vendor = "Intel Xeon" if "XEON" in upper else "Intel"
    else:
        vendor = cpu.strip() or "unknown CPU"
    if not flags:
        return f"{vendor} (ISA not recorded)"
    have = set(flags)
    if vendor.startswith("AMD"):
        if "avx512_bf16" in have:
            # Zen 5 added AVX-VNNI and VP2INTERSECT; Zen 4 has AVX-512 BF16 without them.
            zen5 = bool(have & {"avx_vnni", "avx512_vp2intersect"})
            return f"{vendor} Zen {5 if zen5 else 4} (AVX-512 BF16)"
        if "avx512f" in have:
            return f"{vendor} (AVX-512)"
        return f"{vendor} Zen 3 or older (AVX2)" if "avx2" in have else f"{vendor} (no AVX2)"
    if have & {"amx_bf16", "amx_tile"}:
        return f"{vendor} (AMX)"
    for flag, label in (("avx512_bf16", "AVX-512 BF16, no AMX"), ("avx512f", "AVX-512"),
                        ("avx2", "AVX2")):
        if flag in have:
            return f"{vendor} ({label})"
    return f"{vendor} (no AVX2)"


def find_records(results: Path) -> list[Record]:
    """Every record of a known kind under `results`, one per kind, variant, stamp and class."""
    groups: dict[tuple[str, str, str, str], list[tuple[str, Any]]] = {}
    for path in sorted(results.rglob("*.json")):
        rel = path.relative_to(results).as_posix()
        for kind, pattern in KINDS.items():
            match = pattern.fullmatch(rel)
            if match is None:
                continue
            data = json.loads(path.read_text())
            if kind == "best-vs-best" and "MODEL=" in str(data.get("command", "")):
                break  # a run on another file: not the default model's comparison
            key = (kind, match.groupdict().get("variant") or "", match["stamp"],
                   cpu_class(*cpu_facts(data)))
            groups.setdefault(key, []).append((rel, data))
            break
    return [Record(kind, variant, stamp, klass, tuple(p for p, _ in files),
                   tuple(d for _, d in files))
            for (kind, variant, stamp, klass), files in sorted(groups.items())]


def newest(records: Iterable[Record]) -> dict[tuple[str, str, str], Record]:
    """{(kind, variant, CPU class): the newest record} (stamps sort by time)."""
    out: dict[tuple[str, str, str], Record] = {}
    for rec in records:
        key = (rec.kind, rec.variant, rec.cpu_class)
        if key not in out or rec.stamp > out[key].stamp:
            out[key] = rec
    return out


class Crossing(NamedTuple):
    """`after` overtakes `before` between two measured points: `before` led (or tied) at
    `x_before`, `after` leads at `x_after`, and no point was measured in between."""

    before: str
    after: str
    x_before: float
    x_after: float


def crossings(xs: Sequence[float], series: Mapping[str, Sequence[float | None]],
              higher_is_better: bool = True) -> list[Crossing]:
    """Every place where the lead between two of `series` changes hands along `xs`.

    Each series holds one value per x (None where it was not measured; those points are
    skipped for its pairs). A tie is no lead: the crossing is placed at the next point where
    one side leads again. Pairs come in sorted order, crossings along x within a pair.
    """
    if list(xs) != sorted(xs):
        raise ValueError(f"xs: must be ascending, got {list(xs)}")
    for name, values in series.items():
        if len(values) != len(xs):
            raise ValueError(f"series: {name!r} has {len(values)} values for {len(xs)} xs")
    sign = 1 if higher_is_better else -1
    out: list[Crossing] = []
    for a, b in combinations(sorted(series), 2):
        leader, x_led = None, None
        for x, va, vb in zip(xs, series[a], series[b]):
            if va is None or vb is None:
                continue
            lead = (va - vb) * sign
            now = a if lead > 0 else b if lead < 0 else None
            if now is not None and leader is not None and now != leader:
                out.append(Crossing(leader, now, x_led, x))
            if now is not None:
                leader = now
            x_led = x
    return out


def leader_throughout(series: Mapping[str, Sequence[float | None]],
                      higher_is_better: bool = True) -> str | None:
    """The one series ahead of every other at every point where both were measured."""
    sign = 1 if higher_is_better else -1
    for name, values in series.items():
        leads = [(mine - theirs) * sign > 0
                 for other, vs in series.items() if other != name
                 for mine, theirs in zip(values, vs) if mine is not None and theirs is not None]
        if leads and all(leads):
            return name
    return None
