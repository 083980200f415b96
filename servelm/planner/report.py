"""Rendering of PlanResults: a human-readable formula chain, or stable JSON.

Owns: text layout (formula, numbers plugged in, result with a human unit) and the JSON shape
{"command", "inputs", <fields...>, "<table_key>", "steps", "notes"}.
Never: computes a planner number.
"""

from __future__ import annotations

import json
import math
from typing import Any

from servelm.planner.chain import PlanResult, Step
from servelm.planner.units import (
    fmt_bytes,
    fmt_count,
    fmt_flops,
    fmt_num,
    fmt_rate,
    fmt_seconds,
)

_HUMAN = {
    "B": fmt_bytes,
    "B/s": fmt_rate,
    "s": fmt_seconds,
    "FLOP": fmt_flops,
    "FLOP/s": lambda x: fmt_flops(x) + "/s",
    "params": fmt_count,
}


def _human(step: Step) -> str:
    raw = fmt_num(step.value)
    pretty = _HUMAN.get(step.unit)
    if pretty is None:
        return f"{raw} {step.unit}".rstrip()
    human = pretty(step.value)
    if human.replace(" ", "") == f"{raw}{step.unit}".replace(" ", ""):
        return f"{raw} {step.unit}"
    return f"{raw} {step.unit}  ({human})"


def _render_steps(steps: tuple[Step, ...]) -> list[str]:
    width = max((len(s.name) for s in steps), default=0)
    lines = []
    for s in steps:
        pad = " " * (width + 3)
        lines.append(f"  {s.name.ljust(width)} = {s.formula}")
        if s.substituted and s.substituted != s.formula:
            lines.append(f"  {pad}= {s.substituted}")
        lines.append(f"  {pad}= {_human(s)}")
    return lines


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return fmt_num(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def _render_table(rows: tuple[dict[str, Any], ...]) -> list[str]:
    if not rows:
        return []
    cols = list(rows[0])
    cells = [[_cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    out = ["  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    out.append("  " + "  ".join("-" * w for w in widths))
    out += ["  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return [line.rstrip() for line in out]


def render_text(result: PlanResult) -> str:
    inputs = "  ".join(f"{k}={_cell(v)}" for k, v in result.inputs.items())
    lines = [f"servelm plan {result.command}: {inputs}", ""]
    lines += _render_steps(result.steps)
    if result.table:
        lines += ["", *_render_table(result.table)]
    if result.notes:
        lines += ["", *(f"  note: {n}" for n in result.notes)]
    return "\n".join(lines)


def _jsonable(v: Any) -> Any:
    # JSON has no infinity; "never" thresholds (e.g. a ridge that is never reached) become null.
    if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
        return None
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def to_json_dict(result: PlanResult) -> dict[str, Any]:
    out: dict[str, Any] = {"command": result.command, "inputs": dict(result.inputs)}
    out.update(result.fields())
    if result.table:
        out[result.table_key] = list(result.table)
    out["steps"] = [
        {"name": s.name, "formula": s.formula, "substituted": s.substituted,
         "value": s.value, "unit": s.unit}
        for s in result.steps
    ]
    out["notes"] = list(result.notes)
    return _jsonable(out)


def render_json(result: PlanResult) -> str:
    return json.dumps(to_json_dict(result), indent=2)
