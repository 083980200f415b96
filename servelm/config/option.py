"""Flag: how a config field appears on the command line, kept in the field's metadata.

Owns: `option(default, help, ...)`, the dataclass field of an option with its flag (names,
argument group, choices, metavar, a parser by name), so that a field's name, type, default
and help are written once, where the field is (config/flags.py builds the flags: the
engine's from EngineArgs, `servelm serve`'s own from ServerConfig and TopologyConfig), and
`no_flag(default)`, a field that code sets and no flag does.
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
    # A callable help or choices is called when the parser is built: a text or a list made
    # from a registry or the hardware table, which the field's module does not import.
    help: str | Callable[[], str]
    names: tuple[str, ...] = ()  # default: --the-field-name; a bool that is on: --no-...
    group: str = "engine"  # a key of the groups the flags are built into (config/flags.py)
    choices: tuple[str, ...] | Callable[[], list[str]] | None = None
    metavar: str | None = None
    parse: str | None = None  # a parser of config/flags.py PARSERS (default: the field's type)
    negatable: bool = False  # a bool with both --x and --no-x (argparse.BooleanOptionalAction)


def option(default: Any, help: str | Callable[[], str], **flag: Any) -> Any:
    """A config field with `default` and its flag (Flag's fields as keywords)."""
    return dataclasses.field(default=default, metadata={FLAG: Flag(help, **flag)})


def no_flag(default: Any) -> Any:
    """A config field that code sets (a test, the caller that builds the config) and no flag
    does: the flag builder passes over it, where a field with neither is an error."""
    return dataclasses.field(default=default, metadata={FLAG: None})
