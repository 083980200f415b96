"""Command-line flags built from config dataclasses: the engine's, shared by `generate`,
`chat`, `serve` and `bench`, and (through the same builder) `servelm serve`'s own.

Owns: add_option_flags, which builds one flag per field of a config dataclass from the field
itself (its name, its type, its default, and the help, names, group, choices and parser in
its metadata: config/option.py); add_engine_cli_args (EngineArgs' fields in GROUPS),
options_from_cli / engine_args_from_cli (the config back from the parsed flags), parse_bytes.
Never: holds a flag, a help text or a default of its own (a new option is a new field with
no edit here), or validates beyond parsing (the dataclasses do).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from servelm.config.engine import EngineArgs
from servelm.config.option import FLAG, Flag

# Each field's Flag.group -> its argument group's title, in the order --help shows them.
GROUPS = {"engine": "engine",
          "parallel": "model parallelism (docs/parallel.md)",
          "lora": "LoRA adapters (docs/lora.md)",
          "kv_tiers": "KV tiers below the device pool (docs/kv_tiers.md)",
          "disagg": "prefill/decode disaggregation (docs/disaggregation.md)",
          "spec": "speculative decoding"}
# Fields each command adds itself (the positional MODEL, with the command's own default).
NOT_FLAGS = frozenset({"model"})
_TYPES: dict[str, Callable] = {"int": int, "float": float}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2GB', '1000000' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    s = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * units[unit])
    return int(s)


def _cpu_kernels_arg(text: str) -> str:
    from servelm.config.cpu_kernel_choice import CpuKernelChoice

    try:
        CpuKernelChoice.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def host_list(text: str) -> tuple[str, ...]:
    """'a.com, B.org' -> ('a.com', 'b.org')."""
    return tuple(h.strip().lower() for h in text.split(",") if h.strip())


# Flag.parse names -> the argparse type.
PARSERS: dict[str, Callable] = {"bytes": parse_bytes, "cpu_kernels": _cpu_kernels_arg,
                                "host_list": host_list}


def flag_fields(args_class, not_flags=frozenset()) -> list[tuple[dataclasses.Field, Flag]]:
    """(field, its Flag) of each field of `args_class` but `not_flags` and the no_flag()
    ones, in the fields' order; a field without a Flag is an error naming it (every option
    is a flag)."""
    out = []
    for field in dataclasses.fields(args_class):
        if field.name in not_flags:
            continue
        if FLAG not in field.metadata:
            raise TypeError(f"{args_class.__name__}.{field.name} has no flag: declare it with "
                            "option(default, help, ...), or no_flag(default) for a field no "
                            "flag sets (servelm/config/option.py)")
        if field.metadata[FLAG] is not None:
            out.append((field, field.metadata[FLAG]))
    return out


def flag_names(field: dataclasses.Field, flag: Flag) -> tuple[str, ...]:
    return flag.names or ("--" + field.name.replace("_", "-"),)


def argument(field: dataclasses.Field, flag: Flag,
             owner: str = "EngineArgs") -> tuple[tuple[str, ...], dict]:
    """The add_argument call (names, keywords) of a field of `owner` with its Flag."""
    names = flag_names(field, flag)
    help_text = flag.help() if callable(flag.help) else flag.help
    kwargs: dict = {"dest": field.name, "default": field.default, "help": help_text}
    base = str(field.type).split("|")[0].strip()
    if base == "bool":
        if flag.negatable:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif field.default and not names[0].startswith("--no-"):
            raise TypeError(f"{owner}.{field.name}: an option that is on names its "
                            "--no- flag (or is negatable: --x and --no-x)")
        else:
            kwargs["action"] = "store_false" if field.default else "store_true"
    elif flag.parse is not None:  # before tuple: a parser may read one value into a tuple
        kwargs["type"] = PARSERS[flag.parse]
    elif base.startswith("tuple"):  # repeatable; the config turns the list into a tuple
        kwargs.update(action="append", default=None)
    elif base != "str":  # argparse keeps a string as it is
        kwargs["type"] = _TYPES[base]
    if flag.choices is not None:
        kwargs["choices"] = list(flag.choices() if callable(flag.choices) else flag.choices)
    if flag.metavar is not None:
        kwargs["metavar"] = flag.metavar
    return names, kwargs


def add_option_flags(parser, args_classes, groups: dict[str, str],
                     not_flags=frozenset()) -> None:
    """One flag per field of each of `args_classes`: into `groups` (Flag.group -> title; each
    group made once, in this order), within a group in the classes' and their fields' order."""
    fields = [(cls.__name__, field, flag) for cls in args_classes
              for field, flag in flag_fields(cls, not_flags)]
    unknown = sorted({f"{owner}: {flag.group}" for owner, _, flag in fields
                      if flag.group not in groups})
    if unknown:
        raise TypeError(f"flag groups {unknown} are not among {list(groups)}")
    for key, title in groups.items():
        group = parser.add_argument_group(title)
        for owner, field, flag in fields:
            if flag.group == key:
                names, kwargs = argument(field, flag, owner)
                group.add_argument(*names, **kwargs)


def add_engine_cli_args(parser, args_class=EngineArgs) -> None:
    """One flag per field of `args_class` (EngineArgs; a test passes another), in GROUPS'
    order and the fields' own order within a group."""
    add_option_flags(parser, (args_class,), GROUPS, NOT_FLAGS)


def options_from_cli(args_class, args, **values):
    """An `args_class` from parsed flags (each field whose dest `args` has), `values` over
    them."""
    names = {f.name for f in dataclasses.fields(args_class)}
    return args_class(**{**{k: v for k, v in vars(args).items() if k in names}, **values})


def engine_args_from_cli(args) -> EngineArgs:
    return options_from_cli(EngineArgs, args)
