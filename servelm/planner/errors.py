"""The planner's one error type.

Owns: PlanInputError, raised for bad user input and naming the offending flag/parameter.
Never: used for programming errors (those stay ordinary exceptions).
"""

from __future__ import annotations


class PlanInputError(ValueError):
    """Bad planner input; `param` is the flag or parameter at fault (e.g. "--gpu")."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def require_positive(param: str, value: float | int | None) -> None:
    if value is None or value <= 0:
        raise PlanInputError(param, f"must be positive, got {value}")


def require_non_negative(param: str, value: float | int | None) -> None:
    if value is None or value < 0:
        raise PlanInputError(param, f"must be >= 0, got {value}")


def require_fraction(param: str, value: float, *, allow_one: bool = True) -> None:
    """Fractions in (0, 1] (or [0, 1) when allow_one is False, e.g. an acceptance rate)."""
    ok = 0 < value <= 1 if allow_one else 0 <= value < 1
    if not ok:
        bounds = "(0, 1]" if allow_one else "[0, 1)"
        raise PlanInputError(param, f"must be in {bounds}, got {value}")
