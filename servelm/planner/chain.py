"""The formula chain: every planner answer is a list of Steps, each a formula with the
numbers plugged in, so a reader can redo the arithmetic by hand.

Owns: Step, Chain (a builder), PlanResult (the base of every command's result dataclass).
Never: formats for a terminal or JSON (report.py does) or computes anything itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Step:
    name: str  # the quantity computed, e.g. "kv_bytes_per_token"
    formula: str  # symbolic right-hand side
    substituted: str  # the same with numbers plugged in
    value: float
    unit: str = ""  # "B", "B/s", "s", "FLOP", "tokens", "params", "" (dimensionless)


class Chain:
    """Collects Steps in order; `add` returns the value so formulas read as assignments."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.notes: list[str] = []

    def add(self, name: str, formula: str, substituted: str, value: float, unit: str = "") -> float:
        self.steps.append(Step(name, formula, substituted, value, unit))
        return value

    def note(self, text: str) -> None:
        self.notes.append(text)

    def extend(self, other: "Chain", prefix: str = "") -> None:
        """Splice a sub-computation's steps in (e.g. the prefill chain inside disagg)."""
        for s in other.steps:
            self.steps.append(dataclasses.replace(s, name=prefix + s.name))
        self.notes.extend(other.notes)


@dataclass(frozen=True)
class PlanResult:
    """Base of each command's result. Subclasses add their stable JSON fields as dataclass
    fields; `inputs`, `steps`, `notes` and `table` are rendering material."""

    command: ClassVar[str] = ""
    table_key: ClassVar[str] = "table"  # JSON key for `table` rows, when there are any

    inputs: dict[str, Any]
    steps: tuple[Step, ...]
    notes: tuple[str, ...]
    table: tuple[dict[str, Any], ...] = field(default=(), kw_only=True)

    _NON_FIELDS: ClassVar[frozenset[str]] = frozenset({"inputs", "steps", "notes", "table"})

    def fields(self) -> dict[str, Any]:
        """The command's stable result fields (everything but the rendering material)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in self._NON_FIELDS
        }
