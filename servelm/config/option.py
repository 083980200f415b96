"""Flag: how an EngineArgs field appears on the command line, kept in the field's metadata.

Owns: `option(default, help, ...)`, the dataclass field of an engine option with its flag
(names, argument group, choices, metavar, a parser by name), so that a field's name, type,
default and help are written once, where the field is (config/flags.py builds the flags).
Never: imports anything of servelm, or builds a parser.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FLAG = "flag"  # the metadata key


@dataclass(frozen=True)
class Flag:
    help: str
    names: tuple[str, ...] = ()  # default: --the-field-name; a bool that is on: --no-...
    group: str = "engine"  # one of config/flags.py GROUPS
    choices: tuple[str, ...] | Callable[[], list[str]] | None = None
    metavar: str | None = None
    parse: str | None = None  # a parser of config/flags.py PARSERS (default: the field's type)


def option(default: Any, help: str, **flag: Any) -> Any:
    """An EngineArgs field with `default` and its flag (Flag's fields as keywords)."""
    return dataclasses.field(default=default, metadata={FLAG: Flag(help, **flag)})
